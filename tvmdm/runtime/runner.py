"""Running a compiled module: input checking, parameter placement, the VM call, outputs in ONNX order.

Shared by ``Compiled`` (fresh from compile) and by modules loaded from an exported artifact, so it needs
nothing but TVM's runtime and numpy (no onnx): a deployment process may set ``TVM_USE_RUNTIME_LIB=1`` before
importing tvmdm, and TVM then loads libtvm_runtime alone, not its compiler (90 instead of 264 MB resident).
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine  # (relax.VirtualMachine; this one loads with libtvm_runtime alone)

from tvmdm.runtime import amx
from tvmdm.core.errors import INDEX_GUARD_MARK as GUARD_MARK, InputError, TvmdmError
from tvmdm.runtime.feeds import DLPACK_CPU, as_mapping, device_tensor, host_array


TRANSFORM_PARAMS = "main_transform_params"  # relax.transform.LiftTransformParams' weight-only function


def _device_for(kind: str):
    return tvm.cuda(0) if kind == "cuda" else tvm.cpu(0)


class ModelRunner:
    """Holds the VM and the parameters on the device; ``run`` checks inputs before anything reaches a kernel."""

    def __init__(self, executable, *, inputs, outputs, params: dict[str, np.ndarray], target_kind: str,
                 index_bounds: dict | None = None, reload_params=None):
        """``reload_params``: a callable returning the weights by name again (a loaded artifact reads its file):
        then the host copy of each weight is dropped once the device has it (a deployed BERT-base would
        otherwise hold its 440 MB of weights twice, three times with the packed copies)."""
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.target_kind = target_kind
        self.index_bounds = dict(index_bounds or {})
        self._executable = executable
        self._param_names = list(params)
        self._host_params = {k: np.asarray(v, order="C") for k, v in params.items()}
        self._reload_params = reload_params
        # The VM and device copies are made on first use, so a CUDA module can be compiled and exported on a
        # machine without a GPU.
        self._vm = None
        self._params = None
        self._transformed = False
        self.uses_amx = False  # kernels on the AMX tile units (tvmdm.runtime.amx): set by compile and load
        # outputs handed over as numpy views of the memory the call made, all but these (None: copy them all,
        # as for an artifact written before the field): set by compile and load (tvmdm.build.output_memory)
        self.copied_outputs: list[int] | None = None

    def _ensure_loaded(self):
        if self._vm is None:
            self.device = _device_for(self.target_kind)
            if not self.device.exist:
                raise TvmdmError(f"this module was compiled for {self.target_kind}, but no {self.target_kind} device "
                                 "is present here: export it and run it on a machine that has one")
            _provide_assert_op()
            amx.prepare(self.uses_amx)
            self._vm = VirtualMachine(self._executable, self.device)
            self._params = []
            for name in self._param_names:
                self._params.append(tvm.runtime.tensor(self._host_params[name], self.device))
                if self._reload_params is not None:
                    del self._host_params[name]  # one weight at a time: the peak stays one copy
            if self._vm.module.implements_function(TRANSFORM_PARAMS):
                # Pre-packed weights (e.g. the merged QKV matrix): made once here, main takes them.
                self._params = list(self._vm[TRANSFORM_PARAMS](self._params))
                self._transformed = True

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.outputs]

    def params(self) -> dict[str, np.ndarray]:
        """The model's weights by ONNX name (inference never changes them; a training step does)."""
        if self._params is None or self._transformed:
            return dict(self._host_params) if len(self._host_params) == len(self._param_names) \
                else dict(self._reload_params())
        return {name: p.numpy() for name, p in zip(self._param_names, self._params)}

    def check_inputs(self, inputs) -> dict[str, np.ndarray]:
        """Return the inputs as contiguous arrays, or raise InputError naming the input, axis or value at fault.
        ``inputs``: any mapping of input name -> numpy array, torch tensor, DLPack exporter or list
        (tvmdm.runtime.feeds)."""
        inputs = as_mapping(inputs)
        expected = self.input_names
        missing = [n for n in expected if n not in inputs]
        extra = sorted(set(inputs) - set(expected))
        if missing or extra:
            parts = ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])
            raise InputError(f"inputs do not match the model: {'; '.join(parts)}; the model takes {expected}")
        sizes: dict[str, tuple[int, str]] = {}
        checked = {}
        for spec in self.inputs:
            value = host_array(spec.name, inputs[spec.name])
            if str(value.dtype) != spec.dtype:
                raise InputError(f"input {spec.name!r} has dtype {value.dtype}, the model expects {spec.dtype}")
            if value.ndim != len(spec.shape):
                raise InputError(f"input {spec.name!r} has rank {value.ndim} (shape {list(value.shape)}), the model "
                                 f"expects rank {len(spec.shape)} {list(spec.shape)}")
            for axis, (want, got) in enumerate(zip(spec.shape, value.shape)):
                if isinstance(want, int) and want != got:
                    raise InputError(f"input {spec.name!r} axis {axis} has size {got}, the model was compiled for "
                                     f"{want} (shape {list(spec.shape)})")
                if isinstance(want, str):
                    if got == 0:
                        raise InputError(f"input {spec.name!r} axis {axis} ({want}) is empty")
                    first = sizes.setdefault(want, (got, spec.name))
                    if first[0] != got:
                        raise InputError(f"dim {want!r} is {first[0]} in input {first[1]!r} but {got} in input "
                                         f"{spec.name!r} (axis {axis})")
            self._check_index_range(spec.name, value)
            checked[spec.name] = np.asarray(value, order="C")  # ascontiguousarray would make 0-d arrays 1-d
        return checked

    def _check_index_range(self, name: str, value: np.ndarray) -> None:
        if name not in self.index_bounds or value.size == 0:
            return
        rows, node = self.index_bounds[name]
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise InputError(f"input {name!r} holds index {bad}, outside [0, {rows}) of the table that node "
                             f"{node!r} gathers from")

    def run(self, output_names_or_inputs, inputs=None, *, dlpack: bool = False) -> list:
        """Run the model: ``run(inputs)``, or as onnxruntime's session ``run(None, inputs)`` (every output) and
        ``run(["name", ...], inputs)`` (those outputs, in that order). Returns numpy arrays, or with
        ``dlpack=True`` TVM tensors that torch.from_dlpack / np.from_dlpack take without a copy."""
        if inputs is None:
            names, inputs = None, output_names_or_inputs
        else:
            names = output_names_or_inputs
        picked = self._output_indices(names)
        checked = self.check_inputs(inputs)
        self._ensure_loaded()
        args = [device_tensor(checked[n], self.device) for n in self.input_names]
        try:
            result = self._vm["main"](*args, *self._params)
        except AssertionError as err:  # the module's own index guard (tvmdm.transform.index_guards)
            message = str(err).strip()
            if GUARD_MARK not in message:
                raise
            raise InputError(message[message.index(GUARD_MARK) + len(GUARD_MARK):].splitlines()[0]) from None
        results = [result] if isinstance(result, tvm.runtime.Tensor) else list(result)
        return [results[i] if dlpack else self._host_array(results[i], i) for i in picked]

    def _host_array(self, tensor: "tvm.runtime.Tensor", index: int) -> np.ndarray:
        """Output ``index`` as a numpy array: on the CPU a view of the memory the call made (no copy; it lives as
        long as the array), where tvmdm.build.output_memory found it the call's own."""
        if self.copied_outputs is not None and index not in self.copied_outputs and \
                self.device.dlpack_device_type() == DLPACK_CPU:
            try:
                return np.from_dlpack(tensor)
            except (TypeError, BufferError, RuntimeError):  # a dtype numpy cannot take through DLPack (bfloat16)
                pass
        return tensor.numpy()

    def _output_indices(self, names) -> list[int]:
        if names is None:
            return list(range(len(self.outputs)))
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise InputError(f"output names must be a list of str or None, got {names!r}")
        unknown = [n for n in names if n not in self.output_names]
        if unknown:
            raise InputError(f"unknown outputs {unknown}; the model's outputs are {self.output_names}")
        return [self.output_names.index(n) for n in names]

    def time(self, inputs: dict[str, np.ndarray], repeat: int = 5) -> list[float]:
        """Seconds per call over ``repeat`` calls (after one warm-up), measured by TVM's time evaluator."""
        checked = self.check_inputs(inputs)
        self._ensure_loaded()
        return self._time_on_device("main", [device_tensor(checked[n], self.device) for n in self.input_names]
                                    + self._params, repeat)

    def _time_on_device(self, function: str, args: list, repeat: int) -> list[float]:
        """Seconds per call of the VM's ``function`` on ``args`` (already on the device), one warm-up first."""
        self._vm.set_input(function, *args)
        timer = self._vm.time_evaluator("invoke_stateful", self.device, number=1, repeat=repeat, min_repeat_ms=0)
        return list(timer(function).results)


def _provide_assert_op() -> None:
    """The VM function behind Relax's assert_op (the index guards use it) is registered by TVM's Relax Python
    package, which a deployed process (TVM_USE_RUNTIME_LIB=1, no relax imported) does not load: register the same
    behaviour there. Arguments: the condition (a bool scalar), a Python format string, its arguments."""
    if tvm.get_global_func("relax.run.assert_op", allow_missing=True) is not None:
        return

    def assert_op(condition, format_str, *format_args):
        value = condition.numpy() if isinstance(condition, tvm.runtime.Tensor) else condition
        if not bool(value):
            shown = [a.numpy() if isinstance(a, tvm.runtime.Tensor) else a for a in format_args]
            raise AssertionError(str(format_str).format(*shown) if format_str else ", ".join(map(str, shown)))

    tvm.register_global_func("relax.run.assert_op", assert_op)
