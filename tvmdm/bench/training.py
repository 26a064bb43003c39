"""``tvmdm bench --train``: one training step (forward, loss, backward, AdamW) of tvmdm vs PyTorch, side by side.

Every system starts from the same weights and takes the same batch (the model's inputs and an MSE target of its
output's shape). Before timing, each takes two steps and the losses they report must agree (the second one
checks the update, too). Then each is timed until its median is stable, as the inference bench does.
Each system takes its steps in a process of its own (tvmdm.bench.isolated), its two checked steps first.
GFLOP/s counts 3x the forward matmul flops (forward, input gradients, weight gradients).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

from tvmdm.bench.inference import format_table, matmul_flops, summarize, write_result
from tvmdm.bench.isolated import Job, run_jobs
from tvmdm.core.errors import Disagreement, TvmdmError
from tvmdm.core.training import BENCH_LR
from tvmdm.core.options import DEFAULT_FUSION
from tvmdm.core.precision import reduced_precision

LR = BENCH_LR


def training_jobs(model: str, proto, batch: int, seq: int, tmp: str, *, target: str = "llvm", torch: bool = True,
                  torch_compile: bool = True, tuning_logs="shipped", lr: float = LR, precisions=("fp32",),
                  fusions=(DEFAULT_FUSION,)):
    """(name -> Job, skipped systems with reasons, the tvmdm TrainStep, the batch every system takes). Each
    precision besides fp32 adds tvmdm[p] and (bf16) torch-eager[bf16] (autocast); each fusion level after the
    first (which "tvmdm" uses) adds tvmdm[fusion=level]. Every step is exported before it takes one, so all
    start from the same weights."""
    import importlib.util

    import onnx

    import tvmdm
    from tvmdm import models
    from tvmdm.bench.quantized import refuse_int8_training
    from tvmdm.core.target import num_cores

    refuse_int8_training(precisions)

    def step_job(precision, fusion=fusions[0]):
        step = tvmdm.compile_train_step(proto, loss="mse", optimizer=tvmdm.AdamW(lr=lr), target=target,
                                        batch=batch, seq=seq, tuning_logs=tuning_logs, precision=precision,
                                        fusion=fusion)
        return step, Job("tvmdm-train", {"step": step.export(os.path.join(tmp, f"step{len(jobs)}.tar"))})

    jobs = {}
    step, jobs["tvmdm"] = step_job("fp32")
    feeds = tvmdm.random_inputs(step, batch=batch, seq=seq)
    labels = np.random.default_rng(1).standard_normal(step.target_spec.shape).astype(np.float32)
    for fusion in fusions[1:]:
        jobs[f"tvmdm[fusion={fusion}]"] = step_job("fp32", fusion)[1]
    reduced = [p for p in precisions if p != "fp32"]
    for precision in reduced:
        jobs[f"tvmdm[{precision}]"] = step_job(precision)[1]
    batch_feeds = dict(feeds, labels=labels)
    if not torch:
        return jobs, {}, step, batch_feeds
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return jobs, {"torch-eager": "not installed; pip install 'tvmdm[dev]'"}, step, batch_feeds
    if model not in models.DEFAULT_MODELS:
        return jobs, {"torch-eager": "PyTorch trains only the embedded models (their twins are HF modules)"}, \
            step, batch_feeds
    model_path = os.path.join(tmp, "model.onnx")
    onnx.save(proto, model_path)

    def torch_job(**spec):
        return Job("torch-train", {"model_name": model, "model": model_path, "threads": num_cores(), "lr": lr,
                                   **spec})

    skipped = {}
    jobs["torch-eager"] = torch_job()
    if "bf16" in reduced:
        jobs["torch-eager[bf16]"] = torch_job(autocast="bf16")
    if torch_compile:
        jobs["torch-compile"] = torch_job(compile=True)
        if "bf16" in reduced:
            jobs["torch-compile[bf16]"] = torch_job(compile=True, autocast="bf16")
    if target.startswith("cuda"):  # the step on the GPU too: fp32, and AMP (fp16 autocast + GradScaler)
        import torch as torch_mod

        if torch_mod.cuda.is_available():
            jobs["torch-cuda"] = torch_job(device="cuda")
            jobs["torch-cuda[fp16]"] = torch_job(device="cuda", autocast="fp16")
        else:
            skipped["torch-cuda"] = "torch sees no CUDA device"
    return jobs, skipped, step, batch_feeds


def check_training_agreement(losses: dict, rtol: float = 1e-3, reduced_rtol: float = 1e-2,
                             reference: str = "tvmdm") -> dict:
    """The first losses of every system, from the same state, must agree with the ``reference`` system's (the
    second on checks the update); systems in reduced precision (a "[bf16]" or "[fp16]" name) within
    ``reduced_rtol``."""
    for name, pair in losses.items():
        tolerance = reduced_rtol if reduced_precision(name) else rtol
        for i, (got, want) in enumerate(zip(pair, losses[reference])):
            if abs(got - want) > tolerance * abs(want):
                raise Disagreement(f"{name} disagrees with {reference} at training step {i + 1}: loss "
                                     f"{got:.7g} vs {want:.7g}")
    return losses


def check_against_autocast(losses: dict, precisions, rtol: float = 1e-2) -> dict:
    """The losses of each reduced precision's systems ("...[p]") against PyTorch eager's step under that
    precision's autocast ("torch-eager[p]"), within ``rtol``: the bound #26 documents for bf16 training."""
    for precision in precisions:
        same = {name: v for name, v in losses.items() if name.endswith(f"[{precision}]")}
        check_training_agreement(same, reduced_rtol=rtol, reference=f"torch-eager[{precision}]")
    return losses


def run_train_bench(model: str, *, batch: int | None = None, seq: int | None = None, target: str = "llvm",
                    min_runs: int = 5, max_seconds: float = 30.0, torch: bool = True, torch_compile: bool = True,
                    json_path: str | None = None, plot_path: str | None = None, tuning_logs="shipped",
                    precisions=("fp32",), fusions=(DEFAULT_FUSION,), out=print) -> dict:
    from tvmdm import models
    from tvmdm.bench.inference import load_model
    from tvmdm.build.shapes import resolve_shapes
    from tvmdm.bench.machine import machine_info
    from tvmdm.core.target import num_cores

    proto = load_model(model)
    if model in models.DEFAULT_MODELS:
        dims = models.default_dims(model)
        batch, seq = batch or dims["batch"], seq or dims["seq"]
    if batch is None or seq is None:
        raise TvmdmError(f"bench --train needs concrete sizes for {model}: give --batch and --seq")
    with tempfile.TemporaryDirectory(prefix="tvmdm-bench-train-") as tmp:
        jobs, skipped, step, batch_feeds = training_jobs(model, proto, batch, seq, tmp, target=target, torch=torch,
                                                         torch_compile=torch_compile, tuning_logs=tuning_logs,
                                                         precisions=precisions, fusions=tuple(fusions))
        for name in jobs:  # each in a process of its own (tvmdm.bench.isolated)
            out(f"  checking and timing {name} training step (a process of its own) ...")
        results = run_jobs(jobs, batch_feeds, min_runs=min_runs, max_seconds=max_seconds)
    losses = check_training_agreement({name: r["losses"] for name, r in results.items()})
    flops = matmul_flops(proto, resolve_shapes(model, None, batch, seq))
    flops = 3 * flops if flops else None
    timings = [summarize(name, r["seconds"], flops) for name, r in results.items()]
    eager = next((t.median_ms for t in timings if t.system == "torch-eager"), None)
    for t in timings:
        t.vs_torch_eager = t.median_ms / eager if eager else None
    out(f"{model} training step (forward + MSE loss + backward + AdamW): batch {batch}, seq {seq}, target {target}, "
        f"fusion {fusions[0]}, "
        f"{num_cores()} threads, {len(step.weight_names)} weight tensors, "
        f"{(flops or 0) / 1e9:.2f} GFLOP of matmuls")
    for line in format_table(timings, ratio="vs_torch_eager", label="vs eager"):
        out(line)
    for name, why in skipped.items():
        out(f"  (skipped {name}: {why})")
    result = {
        "schema": "tvmdm-bench-train/1", "model": model, "shapes": {"batch": batch, "seq": seq}, "target": target,
        "threads": num_cores(), "machine": machine_info(num_cores()), "matmul_flops_per_step": flops,
        "timings": [dataclasses.asdict(t) for t in timings], "ratio": "vs_torch_eager",
        "losses_first_two_steps": losses, "skipped": skipped,
        "torch_eager_over_tvmdm": (eager / timings[0].median_ms) if eager else None,
    }
    by_name = {t.system: t.median_ms for t in timings}
    if "tvmdm[bf16]" in by_name and "torch-eager[bf16]" in by_name:
        result["torch_eager_bf16_over_tvmdm_bf16"] = by_name["torch-eager[bf16]"] / by_name["tvmdm[bf16]"]
        out(f"tvmdm[bf16] vs torch-eager[bf16] (autocast): {result['torch_eager_bf16_over_tvmdm_bf16']:.2f}x faster")
    return write_result(result, json_path, plot_path, out)
