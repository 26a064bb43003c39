"""compile(): import -> fuse -> schedule -> relax.build, returning a runnable ``Compiled``."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import tvm

from tvmdm.build.check import CheckResult, compare_outputs, ort_session
from tvmdm.build.options import make_options
from tvmdm.build.output_memory import outputs_to_copy
from tvmdm.transform.ir import has_symbolic_inputs
from tvmdm.build.pipeline import build
from schedules.logs import token_rows
from tvmdm.core.errors import ShapeError, TvmdmError
from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT
from tvmdm.core.precision import check_precision
from tvmdm.core.target import make_target
from tvmdm.runtime.runner import ModelRunner

log = logging.getLogger("tvmdm")


class Compiled(ModelRunner):
    """A compiled model. ``run`` executes it; ``check`` compares with onnxruntime; ``export`` writes an artifact."""

    def __init__(self, built, imported, options):
        super().__init__(built.executable, inputs=imported.inputs, outputs=imported.outputs, params=imported.params,
                         target_kind=options.target_kind, index_bounds=imported.index_bounds)
        self.imported = imported
        self.options = options
        self.target, self.fusion, self.precision = options.target, options.fusion, options.precision
        self.timings = built.timings
        self.kernel_ops = built.kernel_ops  # every TIR kernel of the module -> the graph ops it covers
        self.kernels = sorted(built.kernel_ops)
        self.tuned_kernels = built.tuned_kernels  # those that got a schedule from the tuning logs
        self.hand_kernels = built.hand_kernels  # those a hand-written schedule took (schedules.*): no log needed
        self.mod = built.mod  # the fused, scheduled IRModule that was built (for analysis and profiling)
        # kernel -> {input index: share of it read}: packed inputs a kernel reads only a slice of
        self.read_fractions = built.read_fractions
        self.uses_amx = built.uses_amx
        self.copied_outputs = outputs_to_copy(built.mod)

    @property
    def source(self) -> str:
        return self.imported.source

    def reference(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Outputs of onnxruntime (CPU) on the source ONNX model."""
        if self.imported.proto is None:
            raise TvmdmError("check() compares against onnxruntime, but this model was compiled from an IRModule")
        return ort_session(self.imported.proto).run(self.output_names, self.check_inputs(inputs))

    def check(self, inputs: dict[str, np.ndarray], atol: float = 1e-4, rtol: float = 1e-4) -> CheckResult:
        return compare_outputs(self.output_names, self.run(inputs), self.reference(inputs), atol, rtol)

    def export(self, path: "str | os.PathLike") -> str:
        from tvmdm.runtime.artifact import export_artifact

        return export_artifact(self, path)


def compile(model, *, target="llvm", shapes: dict | None = None, tuning_logs="shipped", fusion: str = DEFAULT_FUSION,
            layout: str = DEFAULT_LAYOUT, precision: str = "fp32", params: dict | None = None, **unknown) -> Compiled:
    """Compile an ONNX model (path or ModelProto) or a Relax IRModule for ``target``.

    IRModule: ``main`` takes the inputs then the weights; give the weights as ``params`` (name -> array) or
    keep them in main's "params" attribute (``from_onnx(keep_params_in_input=True)``).
    shapes: input name -> concrete shape to bind; dims left unbound stay symbolic (one module, many shapes).
    fusion: "paper" (default: the paper's fusion rules, then stock FuseOps), "tvm" (stock FuseOps) or "none".
    layout: the attention's Q/K/V/context layout under fusion="paper": "bshd" (read and written where the
    projections put them, no transposes) or "bhsd" (head-major copies, as the ONNX graph writes).
    precision: "fp32"; "bf16" (CPU): the contractions read bf16 operands with fp32 accumulation
    (AMX tiles where the CPU has them, else AVX512-BF16; symbolic rows in whole tiles of 32; with AMX the
    attention runs as one tile kernel, tvmdm.transform.tile_attention); "fp16" (CUDA):
    they read fp16 operands (tensor cores), fp32 out;
    "bf16" on CUDA: bf16 operands (dlight has no bf16 tensor-core rule: SIMT kernels).
    Everything else stays fp32; see tvmdm.transform.precision.
    tuning_logs: "shipped" (the logs in tuning_logs/ tuned for this target kind), a log directory or a list
    of them, or None. Kernels without a record get our default schedule. Tuned records are for static
    shapes: bind ``shapes`` to the tuned (batch, seq) to use them.
    """
    if unknown:
        raise TypeError(f"compile() got unknown options {sorted(unknown)}")
    t0 = time.perf_counter()
    target = make_target(target)
    check_precision(precision, target.kind.name)
    imported = _import(model, shapes, params)
    import_seconds = time.perf_counter() - t0
    options = make_options(target, fusion=fusion, layout=layout, precision=precision, tuning_logs=tuning_logs,
                           symbolic=has_symbolic_inputs(imported.mod),
                           rows=token_rows([spec.shape for spec in imported.inputs]))
    built = build(imported.mod, options)
    built.timings = {"import": import_seconds, **built.timings}
    log.info("compiled %s for %s: %d/%d kernels tuned, %d by hand; %s", imported.source, options.target_kind,
             len(built.tuned_kernels), len(built.kernel_ops), len(built.hand_kernels),
             ", ".join(f"{k} {v:.2f}s" for k, v in built.timings.items()))
    return Compiled(built, imported, options)


def _import(model, shapes, params):
    from onnx_import import import_onnx, import_relax

    if isinstance(model, tvm.IRModule):
        if shapes:
            raise ShapeError("shapes= applies to ONNX models; an IRModule carries its own shapes")
        return import_relax(model, params)
    if params is not None:
        raise TypeError("params= is for IRModule input; ONNX models carry their weights")
    return import_onnx(model, shapes=shapes)


