"""compile(): import -> fuse -> schedule -> relax.build, returning a runnable ``Compiled``."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np
import tvm
from tvm import relax

from tvmdm import fuse as fuse_stage
from tvmdm.errors import ShapeError, TvmdmError
from tvmdm.precision import check_precision, check_static_shapes
from tvmdm.runtime import ModelRunner
from tvmdm.target import make_target, vector_lanes

log = logging.getLogger("tvmdm")


@dataclasses.dataclass
class OutputCheck:
    name: str
    max_abs_err: float
    max_rel_err: float  # relative to the largest magnitude in the reference output
    ok: bool


@dataclasses.dataclass
class CheckResult:
    """tvmdm vs onnxruntime on the same inputs, output by output."""

    outputs: list[OutputCheck]
    atol: float
    rtol: float

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def max_abs_err(self) -> float:
        return max(o.max_abs_err for o in self.outputs)

    def __str__(self) -> str:
        rows = [f"  {o.name}: max abs err {o.max_abs_err:.3g}, rel {o.max_rel_err:.3g} "
                f"{'ok' if o.ok else 'MISMATCH'}" for o in self.outputs]
        return f"check vs onnxruntime (atol={self.atol}, rtol={self.rtol}): {'ok' if self.ok else 'FAILED'}\n" + \
            "\n".join(rows)


def ort_session(proto, threads: int | None = None):
    """An onnxruntime CPU session on ``proto``, quiet; ``threads`` pins intra-op threads (None: ORT's default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def compare_outputs(names, got, ref, atol: float, rtol: float) -> CheckResult:
    checks = []
    for name, g, r in zip(names, got, ref):
        if g.shape != r.shape:
            checks.append(OutputCheck(name, float("inf"), float("inf"), False))
            continue
        diff = np.abs(g.astype(np.float64) - r.astype(np.float64))
        scale = float(np.abs(r).max()) if r.size else 0.0
        abs_err = float(diff.max()) if diff.size else 0.0
        ok = bool(np.all(diff <= atol + rtol * np.abs(r)))
        checks.append(OutputCheck(name, abs_err, abs_err / scale if scale else abs_err, ok))
    return CheckResult(checks, atol, rtol)


class Compiled(ModelRunner):
    """A compiled model. ``run`` executes it; ``check`` compares with onnxruntime; ``export`` writes an artifact."""

    def __init__(self, executable, imported, target, fusion: str, timings: dict[str, float],
                 kernel_ops: dict[str, list[str]], tuned_kernels: list[str], mod,
                 read_fractions: dict[str, dict[int, float]] | None = None, precision: str = "fp32",
                 hand_kernels: list[str] | None = None):
        super().__init__(executable, inputs=imported.inputs, outputs=imported.outputs, params=imported.params,
                         target_kind=target.kind.name, index_bounds=imported.index_bounds)
        self.imported = imported
        self.target = target
        self.fusion = fusion
        self.precision = precision
        self.timings = timings
        self.kernel_ops = kernel_ops  # every TIR kernel of the module -> the graph ops it covers
        self.kernels = sorted(kernel_ops)
        self.tuned_kernels = tuned_kernels  # those that got a schedule from the tuning logs
        self.hand_kernels = list(hand_kernels or [])  # those a hand-written schedule took (schedules.*): no log needed
        self.mod = mod  # the fused, scheduled IRModule that was built (for analysis and profiling)
        # kernel -> {input index: share of it read}: packed inputs a kernel reads only a slice of
        self.read_fractions = dict(read_fractions or {})

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
        from tvmdm.artifact import export_artifact

        return export_artifact(self, path)


def compile(model, *, target="llvm", shapes: dict | None = None, tuning_logs="shipped", fusion: str = fuse_stage.DEFAULT_FUSION,
            layout: str = "bshd", precision: str = "fp32", params: dict | None = None, **options) -> Compiled:
    """Compile an ONNX model (path or ModelProto) or a Relax IRModule for ``target``.

    IRModule: ``main`` takes the inputs then the weights; give the weights as ``params`` (name -> array) or
    keep them in main's "params" attribute (``from_onnx(keep_params_in_input=True)``).
    shapes: input name -> concrete shape to bind; dims left unbound stay symbolic (one module, many shapes).
    fusion: "paper" (default: the paper's fusion rules, then stock FuseOps), "tvm" (stock FuseOps) or "none".
    layout: the attention's Q/K/V/context layout under fusion="paper": "bshd" (read and written where the
    projections put them, no transposes) or "bhsd" (head-major copies, as the ONNX graph writes).
    precision: "fp32"; "bf16" (CPU): the contractions read bf16 operands with fp32 accumulation
    (AVX512-BF16; needs static shapes); "fp16" (CUDA): they read fp16 operands (tensor cores), fp32 out;
    "bf16" on CUDA: bf16 operands (dlight has no bf16 tensor-core rule: SIMT kernels).
    Everything else stays fp32; see tvmdm.precision.
    tuning_logs: "shipped" (the logs in tuning_logs/ tuned for this target kind), a log directory or a list
    of them, or None. Kernels without a record get our default schedule. Tuned records are for static
    shapes: bind ``shapes`` to the tuned (batch, seq) to use them.
    """
    if options:
        raise TypeError(f"compile() got unknown options {sorted(options)}")
    from schedules.apply import kernels

    tvm_target = make_target(target)
    check_precision(precision, tvm_target.kind.name)
    timings = {}
    t0 = time.perf_counter()
    imported = _import(model, shapes, params)
    if precision == "bf16" and tvm_target.kind.name == "llvm":
        check_static_shapes(imported.mod)
    timings["import"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    provenance: dict[str, list[str]] = {}
    read_fractions: dict[str, dict[int, float]] = {}
    tuning_logs = resolve_logs(tuning_logs, tvm_target)
    lanes = packed_lanes(tuning_logs, tvm_target, precision, symbolic=has_symbolic_inputs(imported.mod))
    mod = fuse_stage.fuse(imported.mod, fusion, provenance, layout, read_fractions, precision=precision,
                          target_kind=tvm_target.kind.name, packed_lanes=lanes)
    mod, tuned, hand = _schedule(mod, tvm_target, tuning_logs, precision, packed=lanes is not None)
    kernel_ops = {k: provenance.get(k, [fuse_stage.op_name(k)]) for k in kernels(mod)}
    timings["fuse+schedule"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    executable = relax.build(mod, target=tvm_target)
    timings["build"] = time.perf_counter() - t0
    log.info("compiled %s for %s: %d/%d kernels tuned, %d by hand; %s", imported.source, tvm_target.kind.name,
             len(tuned), len(kernel_ops), len(hand), ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return Compiled(executable, imported, tvm_target, fusion, timings, kernel_ops, tuned, mod, read_fractions,
                    precision, hand_kernels=hand)


def _import(model, shapes, params):
    from onnx_import import import_onnx, import_relax

    if isinstance(model, tvm.IRModule):
        if shapes:
            raise ShapeError("shapes= applies to ONNX models; an IRModule carries its own shapes")
        return import_relax(model, params)
    if params is not None:
        raise TypeError("params= is for IRModule input; ONNX models carry their weights")
    return import_onnx(model, shapes=shapes)


def resolve_logs(tuning_logs, target):
    """"shipped" -> the shipped logs tuned for ``target`` (a list, maybe empty); anything else as given."""
    from schedules import shipped_logs

    return shipped_logs(target) if isinstance(tuning_logs, str) and tuning_logs == "shipped" else tuning_logs


def packed_lanes(tuning_logs, target, precision: str, symbolic: bool = False) -> int | None:
    """The weight panel width for schedules.packed when the fp32 contractions have no records tuned on this CPU
    model: no log suits it, the logs were tuned on another model (schedules.apply.tuned_on_this_cpu; their
    records still serve the other kernels), or the module has symbolic (batch, seq) dims (records are for
    static shapes only: a symbolic module would fall to the default schedules, ~9x slower on BERT-base). An
    explicit ``tuning_logs=None`` keeps the plain default schedules, a user's log directory (no meta.json) its
    own records."""
    from schedules.apply import tuned_on_this_cpu
    from schedules.packed import panel_lanes

    if target.kind.name != "llvm" or precision != "fp32" or not isinstance(tuning_logs, list):
        return None
    if not symbolic and any(tuned_on_this_cpu(logs_dir, target) for logs_dir in tuning_logs):
        return None
    return panel_lanes(target)


def has_symbolic_inputs(mod: tvm.IRModule) -> bool:
    """Whether any tensor input of ``main`` has a symbolic dim."""
    from tvmdm.graph_rewrites import static_shape

    return any(getattr(p.ty, "shape", None) is not None and static_shape(p) is None for p in mod["main"].params)


def _schedule(mod, target, tuning_logs, precision: str = "fp32",
              packed: bool = False) -> tuple[tvm.IRModule, list[str], list[str]]:
    """Tuned records where the logs have them, our default schedules for every other kernel; on the CPU first
    the hand-written schedules: column reductions and 2-D transposes (schedules.reductions, .transposes), the
    packed fp32 contractions (schedules.packed) and, under bf16, the contractions and conversions
    (schedules.bf16); the paper's attention kernels (schedules.attention) and row-wise normalizations
    (schedules.rows: LayerNorm, BDRLN, softmax, BLNRD) before the logs when the contractions are
    packed (the records come from another CPU model: 5.5 ms for SM from the Zen 4 log on a Sapphire Rapids VM,
    1.5 ms by hand), after them otherwise.
    ``tuning_logs``: as resolve_logs returns them; ``packed``: the fuse stage packed the weights
    (packed_lanes), so there are packed kernels to look for. Returns the module, the kernels scheduled from the
    logs and those scheduled by hand."""
    from schedules import apply_default_schedules, apply_tuning_logs
    from schedules.attention import apply_attention_schedules
    from schedules.bf16 import apply_bf16_schedules
    from schedules.packed import apply_packed_schedules
    from schedules.reductions import apply_reduction_schedules
    from schedules.rows import apply_row_schedules
    from schedules.transposes import apply_transpose_schedules

    tuned, hand = [], []

    def by_hand(result):  # collect the kernels a hand-written schedule took
        hand.extend(result[1])
        return result[0]

    def rows_and_attention(mod):
        mod = by_hand(apply_attention_schedules(mod, vector_lanes(target)))
        return by_hand(apply_row_schedules(mod, vector_lanes(target)))

    if target.kind.name == "llvm":
        mod = by_hand(apply_transpose_schedules(by_hand(apply_reduction_schedules(mod))))

    if packed:  # no records tuned on this CPU model: our kernels before any record from another one
        mod = rows_and_attention(by_hand(apply_packed_schedules(mod, target)))
    if precision == "bf16" and target.kind.name == "llvm":
        mod = by_hand(apply_bf16_schedules(mod, target))  # hand-written micro-kernel: no log needed
    if tuning_logs:
        mod, tuned = apply_tuning_logs(mod, target, tuning_logs)
    if target.kind.name == "llvm" and not packed:  # after the logs: only kernels they have no record for
        mod = rows_and_attention(mod)
    return apply_default_schedules(mod, target), tuned, sorted(hand)
