"""Checking a compiled model's outputs against onnxruntime's."""
from __future__ import annotations

import dataclasses

import numpy as np


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


def ort_session(proto, threads: int | None = None, optimized: bool = True):
    """An onnxruntime CPU session on ``proto``, quiet; ``threads`` pins intra-op threads (None: ORT's default);
    ``optimized``: False turns its graph optimizations off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
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
