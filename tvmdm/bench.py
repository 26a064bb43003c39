"""Benchmark: tvmdm against onnxruntime on the same model, inputs and thread count, in one run.

Every system's outputs are compared before anything is timed (a fast wrong answer is a failure). Times are
medians over repeats after warm-up; per-kernel GFLOP/s are set against this machine's measured GEMM peak.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import time

import numpy as np


@dataclasses.dataclass
class Timing:
    system: str
    median_ms: float
    p10_ms: float
    p90_ms: float


def time_call(fn, *, warmup: int = 2, repeat: int = 10, max_seconds: float = 60.0) -> list[float]:
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() - start < max_seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def summarize(system: str, seconds: list[float]) -> Timing:
    ms = np.asarray(seconds) * 1e3
    return Timing(system, float(np.median(ms)), float(np.percentile(ms, 10)), float(np.percentile(ms, 90)))


def run_bench(model: str, *, batch: int | None = None, seq: int | None = None, target: str = "llvm",
              repeat: int = 10, untuned: bool = False, kernels: bool = True, json_path: str | None = None,
              out=print) -> dict:
    import onnxruntime as ort
    import tvm

    import tvmdm
    from tvmdm.build import compare_outputs, ort_session
    from tvmdm.cli import _model_arg, resolve_shapes
    from tvmdm.profile import gemm_peak_gflops, profile_kernels
    from tvmdm.target import num_cores

    threads = num_cores()
    shapes = resolve_shapes(model, None, batch, seq)
    proto = _model_arg(model)
    if isinstance(proto, str):
        from onnx_import.loader import load_model_proto

        proto, _ = load_model_proto(proto)
    systems = {"tvmdm": tvmdm.compile(proto, target=target, shapes=shapes)}
    if untuned:
        systems["tvmdm-untuned"] = tvmdm.compile(proto, target=target, shapes=shapes, tuning_logs=None)
    first = systems["tvmdm"]
    feeds = tvmdm.random_inputs(first, batch=batch or 1, seq=seq or 1)
    sess = ort_session(proto, threads)
    reference = sess.run(first.output_names, feeds)
    for name, compiled in systems.items():
        check = compare_outputs(first.output_names, compiled.run(feeds), reference, atol=1e-3, rtol=1e-3)
        if not check.ok:
            raise AssertionError(f"{name} disagrees with onnxruntime before timing:\n{check}")

    timings = [summarize("onnxruntime", time_call(lambda: sess.run(first.output_names, feeds), repeat=repeat))]
    for name, compiled in systems.items():
        timings.append(summarize(name, time_call(lambda c=compiled: c.run(feeds), repeat=repeat)))
    ort_ms = timings[0].median_ms
    out(f"{model}: shapes {shapes}, target {target}, {threads} threads, "
        f"{len(first.tuned_kernels)}/{len(first.kernels)} kernels tuned")
    out(f"{'system':<16}{'median ms':>11}{'p10':>9}{'p90':>9}{'vs ORT':>9}")
    for t in timings:
        out(f"{t.system:<16}{t.median_ms:>11.2f}{t.p10_ms:>9.2f}{t.p90_ms:>9.2f}{t.median_ms / ort_ms:>8.2f}x")

    result = {
        "model": model, "shapes": shapes, "target": target, "threads": threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads,
                    "tvm": tvm.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__},
        "tuned_kernels": first.tuned_kernels, "kernels_total": len(first.kernels),
        "timings": [dataclasses.asdict(t) for t in timings],
        "tvmdm_over_onnxruntime": timings[1].median_ms / ort_ms,
    }
    if kernels and target == "llvm":
        peak = gemm_peak_gflops()
        rows = profile_kernels(first.mod, first.target)
        total = sum((r.seconds or 0) * r.calls for r in rows)
        out(f"\nper kernel (each built and timed alone; GEMM peak measured here: {peak:.0f} GFLOP/s)")
        out(f"{'kernel':<58}{'calls':>6}{'ms':>9}{'share':>7}{'GFLOP/s':>9}{'% peak':>8}")
        for r in rows:
            gf = r.gflops_per_s or 0
            pct = f"{100 * gf / peak:>7.0f}%" if r.is_contraction else ""
            out(f"{r.name[:57]:<58}{r.calls:>6}{(r.seconds or 0) * 1e3:>9.3f}"
                f"{100 * (r.seconds or 0) * r.calls / total:>6.1f}%{gf:>9.1f}{pct}")
        result["gemm_peak_gflops"] = peak
        result["kernels"] = [dict(dataclasses.asdict(r), gflops_per_s=r.gflops_per_s) for r in rows]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        out(f"wrote {json_path}")
    return result
