"""Bar plot of a ``tvmdm bench`` result (median with p10-p90 whiskers, ratio to onnxruntime), plus the size scan."""
from __future__ import annotations

from tvmdm.core.extras import require


def plot_bench(result: dict, path: str) -> str:
    require("plot", "a benchmark plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scan = result.get("scan") or []
    fig, axes = plt.subplots(1, 2 if scan else 1, figsize=(13 if scan else 7, 4.5), squeeze=False)
    _bars(axes[0][0], result)
    if scan:
        _scan_lines(axes[0][1], scan)
    fig.suptitle(title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def title(result: dict) -> str:
    """Plain words: "bert-base-layer, batch 8 x seq 128, training step, on AMD EPYC (2 threads)"."""
    what = ", training step" if result.get("ratio") == "vs_torch_eager" else ""
    return f"{result['model']}, {size(result['shapes'])}{what}, on {result['machine']['cpu']['model']} " \
           f"({result['threads']} threads)"


def size(shapes: dict) -> str:
    """The (batch, seq) of the bound shapes when every input agrees on them, else each input's dims (a training
    bench gives {"batch": B, "seq": S} itself)."""
    if set(shapes) == {"batch", "seq"}:
        return f"batch {shapes['batch']} x seq {shapes['seq']}"
    pairs = {tuple(shape[:2]) for shape in shapes.values() if len(shape) >= 2}
    if len(pairs) == 1:
        batch, seq = next(iter(pairs))
        return f"batch {batch} x seq {seq}"
    return ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in shapes.items())


def _bars(ax, result: dict) -> None:
    timings = result["timings"]
    names = [t["system"] for t in timings]
    medians = [t["median_ms"] for t in timings]
    low = [t["median_ms"] - t["p10_ms"] for t in timings]
    high = [t["p90_ms"] - t["median_ms"] for t in timings]
    colors = ["tab:blue" if n.startswith("tvmdm") else "tab:orange" if n.startswith("onnx") else "tab:green"
              for n in names]
    ax.barh(names, medians, xerr=[low, high], color=colors, capsize=3)
    ratio = result.get("ratio", "vs_onnxruntime")
    baseline = {"vs_onnxruntime": "ORT", "vs_torch_eager": "torch eager"}[ratio]
    for y, t in enumerate(timings):
        versus = f" ({t[ratio]:.2f}x {baseline})" if t.get(ratio) is not None else ""
        ax.text(t["p90_ms"], y, f"  {t['median_ms']:.3g} ms{versus}", va="center", fontsize=8)
    ax.invert_yaxis()
    # a log axis: one slow system (an untuned build, a GPU-less fallback) must not flatten the others' bars
    ax.set_xscale("log")
    ax.set_xlabel("median latency, ms, log scale (whiskers: p10-p90)")
    ax.set_xlim(min(t["p10_ms"] for t in timings) / 2, max(t["p90_ms"] for t in timings) * 8)
    ax.grid(True, axis="x", which="both", alpha=0.3)


def _scan_lines(ax, scan: list[dict]) -> None:
    """One line per (system, sweep): seq swept at a fixed batch (solid), batch swept at a fixed seq (dashed)."""
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in scan:
        for sweep in row["sweeps"]:
            for t in row["timings"]:
                series.setdefault((t["system"], sweep), []).append((row["batch"] * row["seq"], t["median_ms"]))
    colors = {}
    for (name, sweep), points in series.items():
        points.sort()
        color = colors.setdefault(name, f"C{len(colors)}")
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o" if sweep == "seq" else "s",
                linestyle="-" if sweep == "seq" else "--", color=color, label=f"{name} ({sweep} sweep)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per call (batch x seq)")
    ax.set_ylabel("median latency, ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
