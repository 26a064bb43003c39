"""``tvmdm bench --train``: one training step (forward, loss, backward, AdamW) of tvmdm vs PyTorch, side by side.

Every system starts from the same weights and takes the same batch (the model's inputs and an MSE target of its
output's shape). Before timing, each takes two steps and the losses they report must agree (the second one
checks the update, too). Then each is timed until its median is stable, as the inference bench does.
GFLOP/s counts 3x the forward matmul flops (forward, input gradients, weight gradients).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tvmdm.bench.inference import format_table, matmul_flops, summarize, write_result
from tvmdm.bench.timing import time_until_stable
from tvmdm.core.errors import TvmdmError
from tvmdm.core.options import DEFAULT_FUSION
from tvmdm.core.precision import reduced_precision

LR = 1e-4


def torch_step(ref, feeds: dict, target: np.ndarray, lr: float, autocast: str | None = None):
    """A PyTorch training step on ``ref``'s module (an HF twin of the ONNX model): returns step() -> loss.
    ``autocast``: "bf16" or "fp16": forward and loss under torch.autocast (PyTorch's mixed precision; fp16 with
    a GradScaler, as AMP is used on CUDA)."""
    import contextlib

    import torch

    ref.module.train()
    optimizer = torch.optim.AdamW(ref.module.parameters(), lr=lr)
    inputs, target_t = ref.torch_inputs(feeds), torch.from_numpy(target).to(ref.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(autocast)
    context = (lambda: torch.autocast(ref.device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler(ref.device.type) if autocast == "fp16" else None

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with context():
            out = ref.forward(inputs)
            loss = torch.nn.functional.mse_loss((out[0] if isinstance(out, tuple) else out).float(), target_t)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.item()  # a host read: the step has finished, as tvmdm's returns its loss

    return step


def training_systems(model: str, proto, batch: int, seq: int, *, target: str = "llvm", torch: bool = True,
                     torch_compile: bool = True, tuning_logs="shipped", lr: float = LR, precisions=("fp32",),
                     fusions=(DEFAULT_FUSION,)):
    """name -> step() callable returning the loss, plus skipped systems with reasons, plus the TrainStep.
    Each precision besides fp32 adds tvmdm[p] and (bf16) torch-eager[bf16] (autocast); each fusion level after
    the first (which "tvmdm" uses) adds tvmdm[fusion=level]."""
    import tvmdm
    from tvmdm import models

    def compile_step(precision, fusion=fusions[0]):
        return tvmdm.compile_train_step(proto, loss="mse", optimizer=tvmdm.AdamW(lr=lr), target=target,
                                        batch=batch, seq=seq, tuning_logs=tuning_logs, precision=precision,
                                        fusion=fusion)

    step = compile_step("fp32")
    feeds = tvmdm.random_inputs(step, batch=batch, seq=seq)
    labels = np.random.default_rng(1).standard_normal(step.target_spec.shape).astype(np.float32)
    systems = {"tvmdm": lambda: step.step(dict(feeds, labels=labels))}
    for fusion in fusions[1:]:
        other = compile_step("fp32", fusion)
        systems[f"tvmdm[fusion={fusion}]"] = lambda s=other: s.step(dict(feeds, labels=labels))
    reduced = [p for p in precisions if p != "fp32"]
    for precision in reduced:
        other = compile_step(precision)
        systems[f"tvmdm[{precision}]"] = lambda s=other: s.step(dict(feeds, labels=labels))
    skipped = {}
    if not torch:
        return systems, skipped, step, feeds
    try:
        import torch as torch_mod

        from tvmdm.models.torch_reference import TorchReference
    except ImportError as err:
        return systems, {"torch-eager": f"not installed ({err.name}); pip install -e '.[dev]'"}, step, feeds
    if model not in models.DEFAULT_MODELS:
        return systems, {"torch-eager": "PyTorch trains only the embedded models (their twins are HF modules)"}, \
            step, feeds
    from tvmdm.core.target import num_cores

    torch_mod.set_num_threads(num_cores())
    systems["torch-eager"] = torch_step(TorchReference(model, proto), feeds, labels, lr)
    if "bf16" in reduced:
        systems["torch-eager[bf16]"] = torch_step(TorchReference(model, proto), feeds, labels, lr, autocast="bf16")
    if torch_compile:
        systems["torch-compile"] = torch_step(TorchReference(model, proto).compile(), feeds, labels, lr)
    if target.startswith("cuda"):  # the step on the GPU too: fp32, and AMP (fp16 autocast + GradScaler)
        if torch_mod.cuda.is_available():
            systems["torch-cuda"] = torch_step(TorchReference(model, proto, device="cuda"), feeds, labels, lr)
            systems["torch-cuda[fp16]"] = torch_step(TorchReference(model, proto, device="cuda"), feeds, labels,
                                                      lr, autocast="fp16")
        else:
            skipped["torch-cuda"] = "torch sees no CUDA device"
    return systems, skipped, step, feeds


def check_training_agreement(systems: dict, rtol: float = 1e-3, reduced_rtol: float = 1e-2) -> dict:
    """Two steps of every system from the same state: the losses must agree (the second checks the update);
    systems in reduced precision (a "[bf16]" or "[fp16]" name) within ``reduced_rtol``."""
    losses = {name: [step(), step()] for name, step in systems.items()}
    reference = losses["tvmdm"]
    for name, pair in losses.items():
        tolerance = reduced_rtol if reduced_precision(name) else rtol
        for i, (got, want) in enumerate(zip(pair, reference)):
            if abs(got - want) > tolerance * abs(want):
                raise AssertionError(f"{name} disagrees with tvmdm at training step {i + 1}: loss {got:.7g} vs "
                                     f"{want:.7g}")
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
    systems, skipped, step, _ = training_systems(model, proto, batch, seq, target=target, torch=torch,
                                                 torch_compile=torch_compile, tuning_logs=tuning_logs,
                                                 precisions=precisions, fusions=tuple(fusions))
    losses = check_training_agreement(systems)
    flops = matmul_flops(proto, resolve_shapes(model, None, batch, seq))
    flops = 3 * flops if flops else None
    timings = []
    for name, fn in systems.items():
        out(f"  timing {name} training step ...")
        timings.append(summarize(name, time_until_stable(fn, warmup=1, min_runs=min_runs, max_seconds=max_seconds),
                                 flops))
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
