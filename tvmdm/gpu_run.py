"""One short prepared GPU session: build, tune briefly, benchmark against onnxruntime-gpu and PyTorch CUDA.

    python -m tvmdm.gpu_run OUT_DIR [--model bert-base-layer] [--budget 540] [--arch sm_90] [--trials 200]

GPU time is lent in short slices, so everything runs under one wall-clock budget: compile with dlight rules,
check against onnxruntime, tune with MetaSchedule until the tuning share of the budget is spent (the log keeps
every finished trial), then the side-by-side benchmark with the tuned log. It writes OUT_DIR/gpu_run.json,
gpu_run.png, gpu_run.log and the tuning database (OUT_DIR/tuning_logs/) to ship under tuning_logs/.
Without a GPU it says so and runs the same steps on this CPU (llvm), which is how the path is tested here.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


class _Log:
    """print() that also appends to OUT_DIR/gpu_run.log, so a run cut off by its time limit still leaves a trace."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def pick_target(arch: str) -> tuple[str, str | None]:
    """(target, why it fell back to the CPU or None)."""
    import tvm

    if tvm.cuda(0).exist:
        return f"cuda:{arch}", None
    return "llvm", "no CUDA device visible to TVM here: ran every step on the CPU instead"


def tune_with_deadline(model: str, logs: str, target: str, trials: int, batch: int, seq: int, seconds: float,
                       log) -> dict:
    """``tvmdm tune`` in a child process, interrupted (SIGINT, as Ctrl-C) when ``seconds`` run out: the
    database keeps every trial joined so far; only the batch in flight is lost."""
    cmd = [sys.executable, "-m", "schedules.tune", model, "--logs", logs, "--target", target, "--trials",
           str(trials), "--batch", str(batch), "--seq", str(seq)]
    log(f"tuning: {' '.join(cmd[1:])} (at most {seconds:.0f} s)")
    t0 = time.perf_counter()
    with open(log.path, "a") as sink:  # the tuner's progress lines go to the log file
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    try:
        child.wait(timeout=max(seconds, 1))
        status = "finished"
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        status = "stopped at its deadline"
    records = 0
    path = os.path.join(logs, "database_tuning_record.json")
    if os.path.exists(path):
        with open(path) as f:
            records = sum(1 for line in f if line.strip())
    log(f"tuning {status} after {time.perf_counter() - t0:.0f} s: {records} records in {logs}")
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "records": records,
            "exit_code": child.returncode}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmdm.gpu_run", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the JSON, plot, log and tuning database")
    parser.add_argument("--model", default="bert-base-layer")
    parser.add_argument("--batch", type=int, help="default: the model's")
    parser.add_argument("--seq", type=int, help="default: the model's")
    parser.add_argument("--arch", default="sm_90", help="CUDA arch (default sm_90: H100/H200)")
    parser.add_argument("--budget", type=float, default=480, help="wall-clock seconds for everything (default 480)")
    parser.add_argument("--tune-share", type=float, default=0.5, help="share of the budget for tuning")
    parser.add_argument("--trials", type=int, default=400, help="most tuning trials (the deadline usually ends it)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    log = _Log(os.path.join(args.out, "gpu_run.log"))
    from tvmdm import models
    from tvmdm.bench import run_bench
    from tvmdm.bench_plot import plot_bench

    dims = models.default_dims(args.model) if args.model in models.DEFAULT_MODELS else {"batch": 1, "seq": 128}
    batch, seq = args.batch or dims["batch"], args.seq or dims["seq"]
    target, fallback = pick_target(args.arch)
    log(f"gpu_run: {args.model} batch {batch} seq {seq} on {target}; budget {args.budget:.0f} s")
    if fallback:
        log(f"NOTE: {fallback}")
    logs = os.path.join(args.out, "tuning_logs")
    tuning = tune_with_deadline(args.model, logs, target, args.trials, batch, seq,
                                args.budget * args.tune_share - (time.perf_counter() - start), log)
    left = args.budget - (time.perf_counter() - start)
    log(f"benchmark ({left:.0f} s left)")
    result = run_bench(args.model, batch=batch, seq=seq, target=target, untuned=True, torch_compile=False,
                       kernels=False, tuning_logs=logs, max_seconds=max(2.0, min(20.0, left / 12)), out=log)
    result["gpu_run"] = {"fallback": fallback, "tuning": tuning, "budget_s": args.budget,
                         "wall_s": round(time.perf_counter() - start, 1)}
    with open(os.path.join(args.out, "gpu_run.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_bench(result, os.path.join(args.out, "gpu_run.png"))
    log(f"wrote gpu_run.json, gpu_run.png in {args.out} after {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
