"""Data-movement analysis, the paper's lens: per kernel call site, its class, flops and bytes moved.

Classes follow "Data Movement Is All You Need": tensor contractions, statistical normalizations and
element-wise operators; a fused kernel takes the heaviest class among the ops it covers. Bytes are the
minimum I/O of the kernel at its boundary (every input read once, the output written once): what fusion
saves is exactly the intermediate tensors that no longer cross a kernel boundary.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import tvm
from tvm import relax

from tvmdm.core.errors import TvmdmError
from tvmdm.core.extras import require
from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT
from tvmdm.analysis.profile import kernel_flops

CONTRACTION_OPS = {"matmul", "einsum", "dense", "conv1d", "conv2d", "batch_matmul",
                   "int8_gemm", "bf16_gemm", "packed_gemm",  # (our rewrites' contractions: tvmdm.transform.kernels)
                   "tile_attention"}  # (the attention's two contractions and softmax: tvmdm.transform.tile_attention)
NORMALIZATION_OPS = {"softmax", "fast_softmax", "layer_norm", "log_softmax", "group_norm", "rms_norm", "mean", "variance", "sum",
                     "max", "min", "std", "batch_norm"}
CLASSES = ("tensor contraction", "statistical normalization", "element-wise")


def classify(ops: list[str]) -> str:
    if any(op in CONTRACTION_OPS for op in ops):
        return CLASSES[0]
    if any(op in NORMALIZATION_OPS for op in ops):
        return CLASSES[1]
    return CLASSES[2]


def _tensor_bytes(ty) -> int | None:
    """Bytes of a tensor type with static shape (None when symbolic); 0 for a scalar argument (a kernel's
    number of key blocks, tvmdm.transform.tile_attention: passed by value, no memory moved)."""
    from tvm import tirx

    if isinstance(ty, tvm.ir.PrimType):
        return 0
    if getattr(ty, "shape", None) is None:
        return None
    dims = list(ty.shape.values)
    if not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return int(np.prod([int(d) for d in dims], dtype=np.int64)) * tvm.DataType(str(ty.dtype)).bits // 8


@dataclasses.dataclass
class KernelRow:
    index: int  # call order in main
    kernel: str
    ops: list[str]
    op_class: str
    flops: int
    bytes_read: int
    bytes_written: int
    seconds: float | None = None

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0


@dataclasses.dataclass
class Report:
    """One row per kernel call site, with totals per class."""

    source: str
    fusion: str
    rows: list[KernelRow]

    def totals(self) -> dict[str, dict[str, float]]:
        flops = sum(r.flops for r in self.rows) or 1
        moved = sum(r.bytes_moved for r in self.rows) or 1
        measured = all(r.seconds is not None for r in self.rows)
        seconds = sum(r.seconds or 0 for r in self.rows) or 1
        out = {}
        for cls in CLASSES:
            rows = [r for r in self.rows if r.op_class == cls]
            out[cls] = {"kernels": len(rows), "flops": sum(r.flops for r in rows),
                        "bytes": sum(r.bytes_moved for r in rows),
                        "flop_pct": 100 * sum(r.flops for r in rows) / flops,
                        "bytes_pct": 100 * sum(r.bytes_moved for r in rows) / moved}
            if measured:
                out[cls]["seconds"] = sum(r.seconds for r in rows)
                out[cls]["time_pct"] = 100 * out[cls]["seconds"] / seconds
        return out

    @property
    def total_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes_moved for r in self.rows)

    def to_json(self) -> dict:
        return {"source": self.source, "fusion": self.fusion,
                "rows": [dict(dataclasses.asdict(r), bytes_moved=r.bytes_moved, intensity=r.intensity)
                         for r in self.rows],
                "totals": self.totals(), "total_flops": self.total_flops, "total_bytes": self.total_bytes}

    def to_csv(self) -> str:
        lines = ["index,kernel,ops,class,flops,bytes_read,bytes_written,intensity,seconds"]
        for r in self.rows:
            lines.append(f"{r.index},{r.kernel},{'+'.join(r.ops)},{r.op_class},{r.flops},{r.bytes_read},"
                         f"{r.bytes_written},{r.intensity:.4g},{'' if r.seconds is None else f'{r.seconds:.6g}'}")
        return "\n".join(lines) + "\n"

    def to_markdown(self) -> str:
        timed = all(r.seconds is not None for r in self.rows)
        head = "| # | kernel | ops | class | MFLOP | MB read | MB written | flop/B |" + (" ms |" if timed else "")
        lines = [f"## {self.source} (fusion: {self.fusion})", "", head,
                 "|" + "---|" * (8 + timed)]
        for r in self.rows:
            ops = "+".join(r.ops) if len(r.ops) <= 6 else "+".join(r.ops[:6]) + "+..."
            lines.append(f"| {r.index} | {r.kernel} | {ops} | {r.op_class} | {r.flops / 1e6:.2f} | "
                         f"{r.bytes_read / 1e6:.3f} | {r.bytes_written / 1e6:.3f} | {r.intensity:.2f} |"
                         + (f" {r.seconds * 1e3:.3f} |" if timed else ""))
        lines += ["", "| class | kernels | % flop | % bytes |" + (" % time |" if timed else ""),
                  "|---|---|---|---|" + ("---|" if timed else "")]
        for cls, t in self.totals().items():
            lines.append(f"| {cls} | {t['kernels']} | {t['flop_pct']:.2f} | {t['bytes_pct']:.2f} |"
                         + (f" {t['time_pct']:.2f} |" if timed else ""))
        lines.append(f"\ntotal: {self.total_flops / 1e9:.3f} GFLOP, {self.total_bytes / 1e6:.2f} MB moved, "
                     f"{len(self.rows)} kernel calls")
        return "\n".join(lines) + "\n"


def report_for(mod: tvm.IRModule, kernel_ops: dict[str, list[str]], source: str, fusion: str,
               measure_target=None, read_fractions: dict | None = None, entry: str = "main") -> Report:
    """Rows for every call_tir in ``mod``'s ``entry`` function (main: inference; a training step's
    "train_step"), in call order. ``read_fractions``: kernel -> {input index: share of that input the kernel
    reads} for inputs read in part (slices of a packed tensor)."""
    from tvmdm.transform.ir import op_name
    from tvmdm.analysis.profile import call_arg_types, time_kernel

    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            calls.append(expr)

    relax.analysis.post_order_visit(mod[entry].body, visit)
    if not calls:
        raise TvmdmError(f"{source}: the compiled graph runs no kernel (empty graph?)")
    flops_cache: dict[str, int] = {}
    times: dict[str, float] = {}
    rows = []
    for index, call in enumerate(calls):
        name = call.args[0].name_hint
        if name not in flops_cache:
            flops_cache[name] = kernel_flops(mod, name, call)
        read = [_tensor_bytes(arg.ty) for arg in call.args[1].fields]
        for i, share in (read_fractions or {}).get(name, {}).items():
            read[i] = None if read[i] is None else int(read[i] * share)
        out_types = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else [call.ty]
        written = [_tensor_bytes(t) for t in out_types]
        if any(b is None for b in read + written):
            raise TvmdmError(f"{source}: kernel {name} has symbolic shapes; bind (batch, seq) to count bytes")
        if measure_target is not None and name not in times:
            times[name] = time_kernel(mod[name], measure_target, arg_types=call_arg_types(call))
        ops = kernel_ops.get(name, [op_name(name)])
        rows.append(KernelRow(index, name, ops, classify(ops), flops_cache[name], sum(read), sum(written),
                              times.get(name)))
    return Report(source, fusion, rows)


def analyze(model, *, fusion: str = DEFAULT_FUSION, shapes: dict | None = None, measure: bool = False,
            tuning_logs="shipped", layout: str = DEFAULT_LAYOUT) -> Report:
    """Report for a compiled model (``tvmdm.Compiled``) or for a model compiled here with ``fusion``."""
    from tvmdm.build.compiled import Compiled, compile

    compiled = model if isinstance(model, Compiled) else compile(
        model, shapes=shapes, fusion=fusion, layout=layout, tuning_logs=tuning_logs if measure else None)
    target = compiled.target if measure else None
    return report_for(compiled.mod, compiled.kernel_ops, compiled.source, compiled.fusion, target,
                      compiled.read_fractions)


def compare(reports: list[Report]) -> list[dict]:
    """Data movement of each report relative to the first (the paper's headline: reduction in %)."""
    base = reports[0]
    return [{"fusion": r.fusion, "kernel_calls": len(r.rows), "bytes": r.total_bytes, "flops": r.total_flops,
             "reduction_vs_" + base.fusion + "_pct": 100 * (1 - r.total_bytes / base.total_bytes)}
            for r in reports]


def memory_bandwidth_gbs(mb: int = 256, repeat: int = 5) -> float:
    """Copy bandwidth (bytes read + written per second) of a large array, as numpy does it."""
    import time

    src = np.ones(mb * 2 ** 20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * src.nbytes / float(np.median(times)) / 1e9


def plot(reports: list[Report], path: str, peak_gflops: float | None = None, bandwidth_gbs: float | None = None):
    """Roofline of the kernels (when timed) beside stacked bars of bytes (and time) by class per pipeline."""
    require("plot", "a roofline plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip(CLASSES, ("tab:blue", "tab:orange", "tab:green")))
    fig, (roof, bars) = plt.subplots(1, 2, figsize=(13, 5))
    timed = [r for r in reports[-1].rows if r.seconds]
    if timed and peak_gflops and bandwidth_gbs:
        x = np.logspace(-2, 3, 100)
        roof.loglog(x, np.minimum(peak_gflops, bandwidth_gbs * x), "k-", label="roofline")
        for cls in CLASSES:
            pts = [(r.intensity, r.flops / r.seconds / 1e9) for r in timed if r.op_class == cls and r.flops]
            if pts:
                roof.scatter(*zip(*pts), color=colors[cls], label=cls)
        roof.set_xlabel("arithmetic intensity (flop/byte)")
        roof.set_ylabel("GFLOP/s")
        roof.legend(fontsize=8)
        roof.set_title(f"{reports[-1].fusion}: kernels vs {peak_gflops:.0f} GFLOP/s, {bandwidth_gbs:.0f} GB/s")
    else:
        roof.text(0.5, 0.5, "kernels not timed (analyze --measure)", ha="center", va="center")
        roof.set_axis_off()
    # Stacked bars by class: MB moved per pipeline, and measured ms beside them where every kernel was timed.
    labels, columns = [], []
    for r in reports:
        totals = r.totals()
        labels.append(f"{r.fusion}\nMB")
        columns.append({cls: totals[cls]["bytes"] / 1e6 for cls in CLASSES})
        if "seconds" in totals[CLASSES[0]]:
            labels.append(f"{r.fusion}\nms")
            columns.append({cls: totals[cls]["seconds"] * 1e3 for cls in CLASSES})
    bottom = np.zeros(len(columns))
    for cls in CLASSES:
        values = np.array([c[cls] for c in columns])
        bars.bar(labels, values, bottom=bottom, color=colors[cls], label=cls)
        bottom += values
    bars.set_ylabel("MB moved at kernel boundaries / ms measured")
    bars.set_title("data movement (and time) by class")
    bars.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def dump(reports: list[Report], fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"reports": [r.to_json() for r in reports], "comparison": compare(reports)}, indent=1)
    if fmt == "csv":
        return "".join(f"# fusion={r.fusion}\n{r.to_csv()}" for r in reports)
    text = "".join(r.to_markdown() + "\n" for r in reports)
    if len(reports) > 1:
        text += "| fusion | kernel calls | MB moved | data movement reduction vs " + reports[0].fusion + " |\n"
        text += "|---|---|---|---|\n"
        for c in compare(reports):
            text += (f"| {c['fusion']} | {c['kernel_calls']} | {c['bytes'] / 1e6:.2f} | "
                     f"{list(c.values())[-1]:.2f}% |\n")
    return text
