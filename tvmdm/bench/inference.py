"""Benchmark harness: tvmdm against onnxruntime (plain and transformer-optimized) and PyTorch, side by side.

One run, same inputs, same thread count. Every system's outputs are compared with onnxruntime's before anything
is timed (a fast wrong answer is a failure). Each system is warmed up, then timed until its median is stable;
the table gives median, p10, p90, GFLOP/s (the model's matmul flops over the median) and the ratio to
onnxruntime. ``scan`` repeats the comparison over (batch, seq) sizes to show how cost grows with work.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
from typing import Callable

import numpy as np

from tvmdm.bench.isolated import Job, run_jobs
from tvmdm.bench.quantized import int8_checks, is_quantized, quantize_dynamic, same_file_bound
from tvmdm.bench.timing import check_agreement, time_until_stable
from tvmdm.core.errors import TvmdmError
from tvmdm.core.options import DEFAULT_FUSION

Runner = Callable[[dict], list]


@dataclasses.dataclass
class Timing:
    system: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    gflops_per_s: float | None = None
    vs_onnxruntime: float | None = None
    vs_torch_eager: float | None = None  # the training bench's baseline


def summarize(system: str, seconds: list[float], flops: int | None = None) -> Timing:
    ms = np.asarray(seconds) * 1e3
    median = float(np.median(ms))
    return Timing(system, median, float(np.percentile(ms, 10)), float(np.percentile(ms, 90)), len(ms),
                  flops / median / 1e6 if flops else None)


def matmul_flops(proto, shapes: dict) -> int | None:
    """2*M*N*K summed over the graph's MatMul nodes at the bound input shapes (None if shapes stay unknown)."""
    import onnx

    model = copy.deepcopy(proto)
    for value in model.graph.input:
        if value.name in shapes:
            for dim, size in zip(value.type.tensor_type.shape.dim, shapes[value.name]):
                dim.Clear()
                dim.dim_value = int(size)
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    known = {}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            known[value.name] = [d.dim_value for d in dims]
    for init in model.graph.initializer:
        known[init.name] = list(init.dims)
    total = 0
    for node in model.graph.node:
        if node.op_type == "MatMul":
            a, out = known.get(node.input[0]), known.get(node.output[0])
            if a is None or out is None:
                return None
            total += 2 * int(np.prod(out)) * a[-1]
    return total


def _tvmdm_systems(proto, shapes, target, fusion_levels, untuned, tuning_logs, precisions=(), int8=None) -> dict:
    import tvmdm

    systems = {}
    for level in fusion_levels:
        name = "tvmdm" if level == fusion_levels[0] else f"tvmdm[fusion={level}]"
        systems[name] = tvmdm.compile(proto, target=target, shapes=shapes, fusion=level, tuning_logs=tuning_logs)
    for precision in precisions:
        if precision == "int8":  # the quantized file (tvmdm.bench.quantized)
            systems["tvmdm[int8]"] = tvmdm.compile(int8, target=target, shapes=shapes, fusion=fusion_levels[0],
                                                   tuning_logs=tuning_logs)
        elif precision != "fp32":
            systems[f"tvmdm[{precision}]"] = tvmdm.compile(proto, target=target, shapes=shapes, fusion=fusion_levels[0],
                                                           tuning_logs=tuning_logs, precision=precision)
    if untuned:
        systems["tvmdm-untuned"] = tvmdm.compile(proto, target=target, shapes=shapes, fusion=fusion_levels[0],
                                                 tuning_logs=None)
    return systems


def ort_runner(session, names) -> Runner:
    return lambda feeds: session.run(names, feeds)


def _onnxruntime_jobs(proto, model_name, threads, gpu: bool, optimized: bool, tmp: str,
                      int8=None) -> tuple[dict, dict]:
    """onnxruntime as shipped, and after onnxruntime.transformers' BERT optimizer (its strongest CPU setup);
    ``int8``: also on that quantized file."""
    import onnx
    import onnxruntime as ort

    from tvmdm import models

    def job(model, providers=("CPUExecutionProvider",)):
        path = os.path.join(tmp, f"ort{len(os.listdir(tmp))}.onnx")
        onnx.save(model, path)
        return Job("onnxruntime", {"model": path, "threads": threads, "providers": list(providers)})

    jobs, skipped = {"onnxruntime": job(proto)}, {}
    if int8 is not None and not gpu:
        jobs["onnxruntime[int8]"] = job(int8)
    if optimized:
        try:
            jobs["onnxruntime-bert-opt"] = job(bert_optimized(proto, models.DEFAULT_MODELS.get(model_name,
                                                                                            (None, None))[1]))
        except Exception as err:  # a best-effort graph rewriter: record why it did not apply, go on without it
            skipped["onnxruntime-bert-opt"] = f"{type(err).__name__}: {err}"
    if gpu:
        if "CUDAExecutionProvider" in ort.get_available_providers():
            jobs["onnxruntime-cuda"] = job(proto, ["CUDAExecutionProvider"])
        else:
            skipped["onnxruntime-cuda"] = f"onnxruntime {ort.__version__} here has no CUDAExecutionProvider " \
                                          "(install onnxruntime-gpu)"
    return jobs, skipped


def bert_optimized(proto, cfg):
    import logging
    import os
    import tempfile

    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    # It warns that our producer name is not "pytorch"; the fusions it finds are reported by the timings.
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    heads, hidden = (cfg.heads, cfg.hidden) if cfg is not None else (0, 0)  # 0: let the optimizer detect them
    with tempfile.TemporaryDirectory() as tmp:
        # It wants a file: given a ModelProto it re-saves initializers as external data and then fails on them.
        path = os.path.join(tmp, "model.onnx")
        onnx.save(proto, path)
        return optimize_model(path, model_type="bert", num_heads=heads, hidden_size=hidden).model


def _torch_jobs(model_name, model_path, threads, torch_compile: bool, gpu: bool,
                precisions=("fp32",)) -> tuple[dict, dict]:
    import importlib.util

    from tvmdm import models

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return {}, {"torch-eager": "not installed; pip install 'tvmdm[dev]'"}
    if model_name not in models.DEFAULT_MODELS:
        return {}, {"torch-eager": "PyTorch runs only the embedded models (their twins are HF modules); an ONNX "
                                   "file carries no PyTorch program"}

    def job(**spec):
        return Job("torch", {"model_name": model_name, "model": model_path, "threads": threads, **spec})

    jobs, skipped = {"torch-eager": job()}, {}
    if torch_compile:
        jobs["torch-compile"] = job(compile=True)
    if "int8" in precisions and not gpu:  # PyTorch's dynamic quantization of the twin's nn.Linear layers
        jobs["torch-eager[int8]"] = job(precision="int8")
    if "bf16" in precisions and not gpu:  # what a user of a bf16 CPU (AMX, AVX512-BF16) runs: oneDNN under autocast
        jobs["torch-eager[bf16]"] = job(precision="bf16")
        if torch_compile:
            jobs["torch-compile[bf16]"] = job(compile=True, precision="bf16")
    if gpu:
        import torch

        if torch.cuda.is_available():  # fp32 strict, TF32 matmuls, fp16 autocast, and inductor on fp32
            jobs["torch-cuda"] = job(device="cuda")
            for precision in ("tf32", "fp16"):
                jobs[f"torch-cuda[{precision}]"] = job(device="cuda", precision=precision)
            if torch_compile:
                jobs["torch-cuda-compile"] = job(device="cuda", compile=True)
        else:
            skipped["torch-cuda"] = "torch sees no CUDA device"
    return jobs, skipped


def reduced_precision_bounds(names) -> dict:
    """system -> its documented max relative error, for the systems whose names say bf16 or fp16."""
    from tvmdm.core.precision import MAX_REL_ERR, reduced_precision

    return {name: MAX_REL_ERR[reduced_precision(name)] for name in names if reduced_precision(name)}


def compare_systems(model: str, proto, shapes: dict, *, target: str = "llvm", fusion_levels=(DEFAULT_FUSION,),
                    precisions=("fp32",), untuned: bool = False, ort_optimized: bool = True, torch: bool = True,
                    torch_compile: bool = True, min_runs: int = 5, max_seconds: float = 30.0,
                    tuning_logs="shipped", kernels: bool = False, symbolic: bool = False, out=print) -> dict:
    """Build every system for one (batch, seq), check them against onnxruntime, time them. Returns a dict with
    timings, agreement, skipped systems and the tvmdm Compiled objects. ``symbolic``: tvmdm's modules are
    compiled with every input dim left symbolic (one module for every size) and run at ``shapes``."""
    import tvmdm
    from tvmdm.build.check import ort_session
    from tvmdm.core.target import num_cores

    threads = num_cores()
    gpu = target.startswith("cuda")
    int8 = quantize_dynamic(proto) if "int8" in precisions else None
    compiled = _tvmdm_systems(proto, {} if symbolic else shapes, target, list(fusion_levels), untuned, tuning_logs,
                              precisions, int8)
    first = next(iter(compiled.values()))
    measured = measure_kernels(first) if kernels and target == "llvm" and not symbolic else None
    feeds = tvmdm.random_inputs(first, batch=1, seq=1, dims=_dims(first, shapes))
    with tempfile.TemporaryDirectory(prefix="tvmdm-bench-") as tmp:
        # each system checked and timed in a process of its own (tvmdm.bench.isolated)
        ort_jobs, skipped = _onnxruntime_jobs(proto, model, threads, gpu, ort_optimized, tmp, int8)
        model_path = ort_jobs["onnxruntime"].spec["model"]
        tvm_jobs = {name: Job("tvmdm", {"artifact": c.export(os.path.join(tmp, f"tvmdm{i}.tvmdm"))})
                    for i, (name, c) in enumerate(compiled.items())}
        torch_jobs, torch_skipped = (_torch_jobs(model, model_path, threads, torch_compile, gpu, precisions)
                                     if torch else ({}, {}))
        skipped.update(torch_skipped)
        jobs = {**ort_jobs, **tvm_jobs, **torch_jobs}
        reference = ort_session(proto, threads).run(first.output_names, feeds)
        flops = matmul_flops(proto, shapes)
        for name in jobs:
            out(f"  checking and timing {name} (a process of its own) ...")
        # a quantized file: every system against onnxruntime on it, to within where a quantization step flips
        relative = dict.fromkeys(jobs, same_file_bound(proto, feeds, first.output_names, threads, reference)) \
            if is_quantized(proto) else reduced_precision_bounds(jobs)
        references, int8_error = {}, None
        if int8 is not None and not is_quantized(proto) and not gpu:
            int8_reference = ort_session(int8, threads).run(first.output_names, feeds)
            same_file = same_file_bound(int8, feeds, first.output_names, threads, int8_reference)
            bounds, references, int8_error = int8_checks(jobs, reference, int8_reference, same_file)
            relative.update(bounds)
            out(f"  int8: onnxruntime on the quantized file is {int8_error:.3g} of the largest output off fp32 "
                f"(the quantization's own error); {', '.join(references)} are checked against its outputs "
                f"to {same_file:.3g}")
        results = run_jobs(jobs, feeds, reference, min_runs=min_runs, max_seconds=max_seconds, relative=relative,
                           references=references)
    agreement = {name: r["max_abs_err"] for name, r in results.items()}
    timings = [summarize(name, results[name]["seconds"], flops) for name in jobs]
    for t in timings:
        t.vs_onnxruntime = t.median_ms / timings[0].median_ms
    return {"timings": timings, "agreement": agreement, "skipped": skipped, "compiled": compiled,
            "flops": flops, "threads": threads, "kernels": measured, "int8_rel_err_vs_fp32": int8_error,
            "checked_against": {name: whose for name, (whose, _) in references.items()}}


def check_and_time(systems: dict, feeds: dict, reference: list, *, min_runs: int = 5, max_seconds: float = 30.0,
                   flops: int | None = None, out=print) -> tuple[dict, list[Timing]]:
    """Each system checked against ``reference`` (onnxruntime's outputs) right before it is timed, in order;
    ratios to the first. Not all checks first: PyTorch's OpenMP threads keep spinning after its kernels, and a
    system timed after them (a tvmdm training step of BERT-base) measured 1.7x slower with a 2.5x spread."""
    relative = reduced_precision_bounds(systems)
    agreement, timings = {}, []
    for name, run in systems.items():
        agreement.update(check_agreement({name: run}, feeds, reference, relative=relative))
        out(f"  timing {name} ...")
        timings.append(summarize(name, time_until_stable(lambda r=run: r(feeds), min_runs=min_runs,
                                                         max_seconds=max_seconds), flops))
    for t in timings:
        t.vs_onnxruntime = t.median_ms / timings[0].median_ms
    return agreement, timings


def _dims(compiled, shapes: dict) -> dict:
    """Symbolic dim name -> size, read off the bound shapes (for synthetic inputs of a symbolic module)."""
    dims = {}
    for spec in compiled.inputs:
        for d, size in zip(spec.shape, shapes.get(spec.name, [])):
            if isinstance(d, str):
                dims[d] = size
    return dims


def format_table(timings: list[Timing], ratio: str = "vs_onnxruntime", label: str = "vs ORT") -> list[str]:
    lines = [f"{'system':<26}{'median ms':>11}{'p10':>9}{'p90':>9}{'runs':>6}{'GFLOP/s':>9}{label:>9}"]
    for t in timings:
        gf = f"{t.gflops_per_s:>9.1f}" if t.gflops_per_s else f"{'':>9}"
        r = getattr(t, ratio)
        lines.append(f"{t.system:<26}{t.median_ms:>11.2f}{t.p10_ms:>9.2f}{t.p90_ms:>9.2f}{t.runs:>6}{gf}"
                     + (f"{r:>8.2f}x" if r is not None else f"{'-':>9}"))
    return lines


def run_bench(model: str, *, batch: int | None = None, seq: int | None = None, target: str = "llvm",
              min_runs: int = 5, max_seconds: float = 30.0, untuned: bool = False, fusion_levels=(DEFAULT_FUSION,),
              precisions=("fp32",), ort_optimized: bool = True, torch: bool = True, torch_compile: bool = True, kernels: bool = True,
              scan: dict | None = None, json_path: str | None = None, plot_path: str | None = None,
              tuning_logs="shipped", symbolic: bool = False, out=print) -> dict:
    """The ``tvmdm bench`` command. ``scan``: {"seq": [...], "batch": [...]} sizes to sweep (None: no sweep).
    ``symbolic``: tvmdm compiled for every size, timed at (batch, seq) (the others see those sizes alone)."""
    from tvmdm.build.shapes import resolve_shapes
    from tvmdm.bench.machine import machine_info

    proto = load_model(model)
    shapes = resolve_shapes(model, None, batch, seq)
    if not shapes:
        raise TvmdmError(f"bench needs concrete sizes for {model}: give --batch and --seq")
    options = dict(target=target, fusion_levels=fusion_levels, precisions=precisions, ort_optimized=ort_optimized, torch=torch,
                   torch_compile=torch_compile, min_runs=min_runs, max_seconds=max_seconds, tuning_logs=tuning_logs,
                   symbolic=symbolic)
    main = compare_systems(model, proto, shapes, untuned=untuned, kernels=kernels, out=out, **options)
    first = next(iter(main["compiled"].values()))
    out(f"{model}: shapes {shapes}{' (tvmdm: one symbolic module)' if symbolic else ''}, target {target}, "
        f"{main['threads']} threads, "
        f"{len(first.tuned_kernels)}/{len(first.kernels)} kernels tuned, "
        f"{(main['flops'] or 0) / 1e9:.2f} GFLOP of matmuls")
    for line in format_table(main["timings"]):
        out(line)
    for name, why in main["skipped"].items():
        out(f"  (skipped {name}: {why})")
    result = {
        "schema": "tvmdm-bench/1", "model": model, "shapes": shapes, "symbolic": symbolic, "target": target,
        "threads": main["threads"],
        "machine": machine_info(main["threads"]), "matmul_flops": main["flops"],
        "tuned_kernels": first.tuned_kernels, "kernels_total": len(first.kernels),
        "timings": [dataclasses.asdict(t) for t in main["timings"]],
        "max_abs_err_vs_onnxruntime": main["agreement"], "skipped": main["skipped"],
        # systems whose max_abs_err is against other outputs than onnxruntime's on the fp32 file
        "checked_against": main["checked_against"], "int8_rel_err_vs_fp32": main["int8_rel_err_vs_fp32"],
        "tvmdm_over_onnxruntime": next(t.vs_onnxruntime for t in main["timings"] if t.system == "tvmdm"),
    }
    for t in main["timings"]:
        if t.system.startswith("tvmdm[") and t.system != "tvmdm":
            result[f"{t.system}_over_onnxruntime"] = t.vs_onnxruntime
    if main["kernels"]:
        result.update(_kernel_table(main["kernels"], out))
    if scan:
        scan_options = dict(options, ort_optimized=False, torch_compile=False, min_runs=3,
                            max_seconds=min(max_seconds, 10.0))
        result["scan"] = scan_sizes(model, proto, scan, out=out, **scan_options)
    return write_result(result, json_path, plot_path, out)


def write_result(result: dict, json_path: str | None, plot_path: str | None, out=print) -> dict:
    """The JSON and the bar plot of a bench result, where asked (inference and training alike)."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        out(f"wrote {json_path}")
    if plot_path:
        from tvmdm.bench.plot import plot_bench

        out(f"wrote {plot_bench(result, plot_path)}")
    return result


def load_model(model):
    from onnx_import.loader import load_model_proto
    from tvmdm.build.shapes import model_or_path

    proto = model_or_path(model) if isinstance(model, str) else model
    return load_model_proto(proto)[0] if isinstance(proto, str) else proto


def scan_sizes(model: str, proto, scan: dict, *, out=print, **options) -> list[dict]:
    """The comparison at every (batch, seq): seq swept at the model's batch, batch swept at its seq."""
    from tvmdm import models
    from tvmdm.build.shapes import resolve_shapes

    base = models.default_dims(model) if model in models.DEFAULT_MODELS else {"batch": 1, "seq": 128}
    sweeps: dict[tuple[int, int], list[str]] = {}
    for s in scan.get("seq", []):
        sweeps.setdefault((base["batch"], s), []).append("seq")
    for b in scan.get("batch", []):
        sweeps.setdefault((b, base["seq"]), []).append("batch")
    rows = []
    for (batch, seq), kinds in sweeps.items():
        out(f"scan: batch {batch}, seq {seq}")
        found = compare_systems(model, proto, resolve_shapes(model, None, batch, seq), out=lambda line: None,
                                **options)
        rows.append({"batch": batch, "seq": seq, "sweeps": kinds, "matmul_flops": found["flops"],
                     "timings": [dataclasses.asdict(t) for t in found["timings"]]})
        out("  " + ", ".join(f"{t.system} {t.median_ms:.1f} ms" for t in found["timings"]))
    return rows


def measure_kernels(compiled) -> dict:
    """Every kernel of ``compiled`` timed alone, and the GEMM peak. Run it before PyTorch is loaded: torch's
    OpenMP threads stay pinned and busy in this process afterwards (measured: peak 106 instead of 181 GFLOP/s,
    the FFN kernel 47 instead of 28 ms)."""
    from tvmdm.analysis.profile import gemm_peak_gflops, profile_kernels

    rows = profile_kernels(compiled.mod, compiled.target)
    return {"gemm_peak_gflops": gemm_peak_gflops(), "rows": rows}


def _kernel_table(measured: dict, out) -> dict:
    peak, rows = measured["gemm_peak_gflops"], measured["rows"]
    total = sum((r.seconds or 0) * r.calls for r in rows) or 1.0
    out(f"\nper kernel (each built and timed alone; GEMM peak measured here: {peak:.0f} GFLOP/s)")
    out(f"{'kernel':<58}{'calls':>6}{'ms':>9}{'share':>7}{'GFLOP/s':>9}{'% peak':>8}")
    for r in rows:
        gf = r.gflops_per_s or 0
        pct = f"{100 * gf / peak:>7.0f}%" if r.is_contraction else ""
        out(f"{r.name[:57]:<58}{r.calls:>6}{(r.seconds or 0) * 1e3:>9.3f}"
            f"{100 * (r.seconds or 0) * r.calls / total:>6.1f}%{gf:>9.1f}{pct}")
    return {"gemm_peak_gflops": peak,
            "kernels": [dict(dataclasses.asdict(r), gflops_per_s=r.gflops_per_s) for r in rows]}
