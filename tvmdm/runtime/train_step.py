"""A compiled training step at run time: forward + loss + backward + AdamW in one compiled function, weights,
Adam moments and the step count on the device between calls.

``load_train_step`` needs TVM's runtime alone (no compiler, no onnx): a step compiled on one machine
(``tvmdm.compile_train_step``, ``TrainStep.export``) trains on another that has only libtvm_runtime.
"""
from __future__ import annotations

import os

import numpy as np
import tvm

from tvmdm.core.errors import InputError
from tvmdm.core.spec import TensorSpec
from tvmdm.core.training import IGNORE_INDEX, AdamW, DropoutConfig, LossScaler, check_learning_rate
from tvmdm.runtime.feeds import as_mapping, device_tensor, host_array
from tvmdm.runtime.runner import ModelRunner

FORMAT = "tvmdm-train-step"
VERSION = 1
TARGET_KEYS = ("labels", "target")  # the batch key holding the loss target (HF calls it labels)


class TrainStep(ModelRunner):
    """A compiled training step. ``step(batch)`` trains once and returns the loss; ``run(inputs)`` is inference
    with the current weights; ``gradients(batch)`` gives the loss and every weight's gradient (no update)."""

    def __init__(self, executable, *, inputs, outputs, params, target_kind, index_bounds, target_spec: TensorSpec,
                 optimizer: AdamW, loss_name: str, moments=None, step_count: int = 0,
                 dropout: DropoutConfig = DropoutConfig(), loss_scaler: LossScaler | None = None):
        super().__init__(executable, inputs=inputs, outputs=outputs, params=params, target_kind=target_kind,
                         index_bounds=index_bounds)
        self.target_spec = target_spec
        self.optimizer = optimizer
        self.loss_name = loss_name
        self.lr = optimizer.lr  # settable: a schedule changes it between steps without recompiling
        self.step_count = step_count
        self.dropout = dropout
        self.loss_scaler = loss_scaler  # dynamic loss scaling (fp16): its scale is an input of every call
        self.memory: dict[str, int] = {}  # bytes: "planned" by relax, "peak_live" tensors (checkpoint.py)
        self.checkpoint = False
        zeros = {n: np.zeros_like(v) for n, v in self._host_params.items()}
        moments = moments or {"m": zeros, "v": zeros}
        self._host_moments = {k: [np.asarray(moments[k][n], order="C") for n in self._host_params] for k in "mv"}
        self._moments = None

    def _ensure_loaded(self):
        super()._ensure_loaded()
        if self._moments is None:
            self._moments = {k: [tvm.runtime.tensor(a, self.device) for a in arrays]
                             for k, arrays in self._host_moments.items()}

    @property
    def weight_names(self) -> list[str]:
        return list(self._host_params)

    def _split_batch(self, batch) -> tuple[list, "tvm.runtime.Tensor"]:
        batch = as_mapping(batch)  # a dict, a BatchEncoding; numpy, torch, DLPack or list values
        keys = [k for k in TARGET_KEYS if k in batch]
        if len(keys) != 1:
            raise InputError(f"a batch needs the loss target under exactly one of {list(TARGET_KEYS)} "
                             f"({self.target_spec.dtype} {list(self.target_spec.shape)}); got keys {sorted(batch)}")
        target = host_array(keys[0], batch[keys[0]])
        spec = self.target_spec
        if not isinstance(target, np.ndarray) or str(target.dtype) != spec.dtype or \
                tuple(target.shape) != tuple(spec.shape):
            got = f"{target.dtype} {list(target.shape)}" if isinstance(target, np.ndarray) else type(target).__name__
            raise InputError(f"batch[{keys[0]!r}] must be {spec.dtype} {list(spec.shape)} for the "
                             f"{self.loss_name} loss, got {got}")
        if self.loss_name == "cross_entropy":
            self._check_labels(keys[0], target)
        checked = self.check_inputs({k: v for k, v in batch.items() if k != keys[0]})
        self._ensure_loaded()
        # the inputs, then the dropout masks of the coming step (the same ones step() and gradients() use)
        args = [device_tensor(checked[n], self.device) for n in self.input_names] + \
            [tvm.runtime.tensor(m, self.device) for m in self.dropout.masks(self.step_count + 1)]
        return args, tvm.runtime.tensor(np.asarray(target, order="C"), self.device)

    def _check_labels(self, key: str, labels: np.ndarray) -> None:
        """Class ids in [0, classes) or IGNORE_INDEX: one_hot of any other id is a row of zeros, a silent loss."""
        classes = int(self.outputs[0].shape[-1])
        bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= classes))]
        if bad.size:
            raise InputError(f"batch[{key!r}] holds class id {int(bad.flat[0])}: the output {self.outputs[0].name!r} "
                             f"has {classes} classes, so ids must be in [0, {classes}) or {IGNORE_INDEX} (ignored)")

    def _scale_args(self, scale: float | None = None) -> list:
        """The loss-scale input of a loss-scaled module (``scale``, or the scaler's): nothing otherwise."""
        if self.loss_scaler is None:
            return []
        value = self.loss_scaler.scale if scale is None else scale
        return [tvm.runtime.tensor(np.array(value, dtype=np.float32), self.device)]

    def step(self, batch: dict) -> float:
        """One training step (forward, loss, backward, AdamW update) on ``batch``; returns the loss. With loss
        scaling, a step whose gradients overflow changes nothing but the scale (as torch's GradScaler)."""
        args = self._train_step_args(batch)  # (loads the module first)
        result = self._vm["train_step"](*args)
        if self.loss_scaler is None:
            self._take_update(list(result[1:]))
        else:
            finite = float(result[len(result) - 1].numpy()) == 0.0
            if finite:
                self._take_update([result[i] for i in range(1, len(result) - 1)])
            self.loss_scaler.update(finite)
        return float(result[0].numpy())

    def time(self, batch: dict, repeat: int = 5) -> list[float]:
        """Seconds per training step over ``repeat`` steps (after one warm-up), timed on the device by TVM's time
        evaluator: batch, weights and moments already there, no loss read back. The state is not advanced (each
        timed step starts from the current weights)."""
        return self._time_on_device("train_step", self._train_step_args(batch), repeat)

    def _train_step_args(self, batch: dict) -> list:
        """train_step's arguments, on the device: inputs (and masks), loss scale, target, weights, moments and
        the coming step's AdamW scalars."""
        args, target = self._split_batch(batch)
        return [*args, *self._scale_args(), target, *self._params, *self._moments["m"], *self._moments["v"],
                *self._update_scalars()]

    def gradients(self, batch: dict) -> tuple[float, dict[str, np.ndarray]]:
        """Loss and the gradient of every weight on ``batch``, without updating anything."""
        loss, grads = self.device_gradients(batch)
        return float(loss.numpy()), {n: g.numpy() for n, g in zip(self.weight_names, grads)}

    def device_gradients(self, batch: dict) -> tuple["tvm.runtime.Tensor", list]:
        """Loss and gradients as device tensors (in ``weight_names`` order), for ``apply_gradients``: what a
        data-parallel step exchanges between them (tvmdm.distributed)."""
        args, target = self._split_batch(batch)
        # Scale 1: plain gradients (a data-parallel step all-reduces and applies them as they are).
        loss, grads = self._vm["loss_and_grads"](*args, *self._scale_args(1.0), target, *self._params)
        if self.loss_scaler is not None:
            loss = loss[1]  # (scaled loss, loss)
        return loss, list(grads)

    def apply_gradients(self, grads: list) -> None:
        """The AdamW update of the weights with ``grads`` (device tensors, ``weight_names`` order): one step."""
        self._ensure_loaded()
        result = self._vm["apply_update"](*self._params, *grads, *self._moments["m"], *self._moments["v"],
                                          *self._update_scalars())
        self._take_update(list(result))

    def _update_scalars(self) -> list:
        """AdamW's per-step inputs (decay, step size, bias correction) for the coming step, on the device."""
        lr = check_learning_rate(self.lr)
        return [tvm.runtime.tensor(s, self.device) for s in self.optimizer.scalars(self.step_count + 1, lr)]

    def _take_update(self, updated: list) -> None:
        n = len(self._params)
        self._params = updated[:n]
        self._moments = {"m": updated[n:2 * n], "v": updated[2 * n:3 * n]}
        self.step_count += 1

    def loss(self, batch: dict) -> float:
        return self.gradients(batch)[0]

    def state_dict(self) -> dict[str, np.ndarray]:
        """Weights and optimizer state as numpy arrays: weights/<name>, adam_m/<name>, adam_v/<name>, step."""
        state = {f"weights/{n}": v for n, v in self.params().items()}
        moments = self._host_moments if self._moments is None else \
            {k: [t.numpy() for t in ts] for k, ts in self._moments.items()}
        for kind, prefix in (("m", "adam_m/"), ("v", "adam_v/")):
            state.update({prefix + n: a for n, a in zip(self.weight_names, moments[kind])})
        state["step"] = np.array(self.step_count, dtype=np.int64)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (all keys, same shapes and dtypes)."""
        expected = set(self.state_dict())
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or extra:
            raise InputError(f"state dict does not match this training step: missing {missing[:5]}"
                             f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}")
        for name, value in state.items():
            want = self.state_dict_spec(name)
            if name != "step" and (tuple(np.shape(value)) != want.shape or str(np.asarray(value).dtype) != want.dtype):
                raise InputError(f"state[{name!r}] is {np.asarray(value).dtype} {list(np.shape(value))}, expected "
                                 f"{want.dtype} {list(want.shape)}")
        self._host_params = {n: np.asarray(state[f"weights/{n}"], order="C") for n in self.weight_names}
        self._host_moments = {k: [np.asarray(state[f"adam_{k}/{n}"], order="C") for n in self.weight_names]
                              for k in "mv"}
        self.step_count = int(state["step"])
        self._params = self._moments = None
        if self._vm is not None:
            self._params = [tvm.runtime.tensor(v, self.device) for v in self._host_params.values()]
            self._ensure_loaded()

    def state_dict_spec(self, name: str) -> TensorSpec:
        weight = self._host_params[name.split("/", 1)[1]] if "/" in name else np.zeros((), np.int64)
        return TensorSpec(name, tuple(weight.shape), str(weight.dtype))

    def manifest(self) -> dict:
        """What ``load_train_step`` needs beside the library and the state to rebuild this step."""
        from tvmdm.runtime.artifact import runner_fields

        return {
            "format": FORMAT, "version": VERSION, **runner_fields(self),
            "target": self.target_spec.to_json(), "loss": self.loss_name, "lr": self.lr,
            "memory": self.memory, "checkpoint": self.checkpoint, "dropout": self.dropout.to_json(),
            "optimizer": {"lr": self.optimizer.lr, "betas": list(self.optimizer.betas), "eps": self.optimizer.eps,
                          "weight_decay": self.optimizer.weight_decay},
            "loss_scaler": self.loss_scaler.to_json() if self.loss_scaler else None,
        }

    def export(self, path: "str | os.PathLike") -> str:
        """Write the step (compiled code, weights, optimizer state) to one file for ``load_train_step``."""
        from tvmdm.runtime.artifact import write_bundle

        return write_bundle(path, self.manifest(), self._executable, self.state_dict())


def load_train_step(path: "str | os.PathLike") -> TrainStep:
    """Load a step written by ``TrainStep.export``: training resumes where it stopped (no onnx needed)."""
    from tvmdm.runtime.artifact import read_bundle

    manifest, lib, state = read_bundle(path, FORMAT, VERSION)
    return train_step_from_parts(manifest, lib, state, path)


def train_step_from_parts(manifest: dict, lib, state: dict, path) -> TrainStep:
    """A step from a manifest (``TrainStep.manifest``), a loaded library and its state (``state_dict``'s
    names); ``path`` names the source in errors."""
    from tvmdm.runtime.artifact import manifest_entries, runner_kwargs

    with manifest_entries(path):
        opt = manifest["optimizer"]
        names = [k.split("/", 1)[1] for k in state if k.startswith("weights/")]
        ts = TrainStep(lib, params={n: state[f"weights/{n}"] for n in names}, **runner_kwargs(manifest),
                       target_spec=TensorSpec.from_json(manifest["target"]),
                       optimizer=AdamW(opt["lr"], tuple(opt["betas"]), opt["eps"], opt["weight_decay"]),
                       loss_name=manifest["loss"],
                       moments={k: {n: state[f"adam_{k}/{n}"] for n in names} for k in "mv"},
                       step_count=int(state["step"]), dropout=DropoutConfig.from_json(manifest["dropout"]),
                       loss_scaler=LossScaler(**manifest["loss_scaler"]) if manifest.get("loss_scaler") else None)
        ts.lr, ts.memory, ts.checkpoint = manifest["lr"], manifest["memory"], manifest["checkpoint"]
        ts.uses_amx = bool(manifest.get("amx", False))
    return ts
