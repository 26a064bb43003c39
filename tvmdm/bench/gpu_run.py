"""One short prepared GPU session: check, benchmark, train, then tune with the time left, in that order.

    python -m tvmdm.bench.gpu_run OUT_DIR [--model bert-base-layer] [--budget 540] [--arch sm_90] [--trials 400]

GPU time is lent in short slices, so everything runs under one wall-clock budget and each step's result is in
OUT_DIR/gpu_run.json as soon as the step ends (a call cut off by its limit keeps what was done; a step that
fails is recorded with its error and the next one runs):
  1. check: compile fp32 (and fp16 on CUDA) with dlight/shipped schedules, compare with onnxruntime;
  2. bench: tvmdm (fp32, fp16) vs onnxruntime (its CUDA provider where installed, else said so), PyTorch
     eager and torch.compile (CUDA on a GPU);
  3. train: the compiled training step (fp32, fp16 with dynamic loss scaling on CUDA) vs a PyTorch step,
     losses of two steps compared;
  4. tune: MetaSchedule until the time left (less a reserve for step 5) is spent; every measured batch is in
     OUT_DIR/tuning_logs at once (ship it as tuning_logs/<model>-cuda);
  5. tuned: the benchmark again with the tuned log.
It also writes gpu_run.png and gpu_run.log. Without a GPU it says so and runs the same steps on this CPU
(llvm), which is how the path is tested here.
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
                       log, first_batch_grace: float = 0.0) -> dict:
    """``tvmdm tune --seconds`` in a child process. Its deadline holds once a batch is measured (it starts no
    build that would end after it, and keeps every measured batch), so it is sent SIGINT only 15 s past the
    deadline, or, while its log has no record yet (the first batch is always measured), up to
    ``first_batch_grace`` seconds later; SIGKILL 15 s after that."""
    cmd = [sys.executable, "-m", "tvmdm", "tune", model, "--logs", logs, "--target", target, "--trials",
           str(trials), "--batch", str(batch), "--seq", str(seq), "--seconds", f"{max(seconds, 1):.0f}"]
    log(f"tuning: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    path = os.path.join(logs, "database_tuning_record.json")
    with open(log.path, "a") as sink:  # the tuner's progress lines go to the log file
        child = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    status = "finished"
    limit = max(seconds, 1) + 15
    while child.poll() is None:
        elapsed = time.perf_counter() - t0
        if elapsed > limit + (0 if os.path.exists(path) else first_batch_grace):
            child.send_signal(signal.SIGINT)
            status = "interrupted after its deadline"
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                status = "killed after its deadline"
            break
        time.sleep(0.5)
    records = 0
    if os.path.exists(path):
        with open(path) as f:
            records = sum(1 for line in f if line.strip())
    log(f"tuning {status} after {time.perf_counter() - t0:.0f} s: {records} records in {logs}")
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "records": records,
            "exit_code": child.returncode}


class Steps:
    """Runs named steps in order, each recorded (result or error, seconds) in gpu_run.json as it ends."""

    def __init__(self, out_dir: str, log, header: dict):
        self.path = os.path.join(out_dir, "gpu_run.json")
        self.log = log
        self.result = dict(header, steps={})
        self._write()

    def run(self, name: str, fn):
        self.log(f"== step {name}")
        t0 = time.perf_counter()
        try:
            value, record = fn(), {}
        except Exception as err:  # noqa: BLE001 - a lease is too short to lose the other steps to one failure
            value, record = None, {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
            self.log(f"step {name} failed: {record['error'][:500]}")
        record = dict(record, result=_jsonable(value), seconds=round(time.perf_counter() - t0, 1))
        self.result["steps"][name] = record
        self._write()
        return value

    def _write(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if k != "compiled"}
    return value


def check_precisions(model: str, target: str, precisions, batch: int, seq: int) -> dict:
    """Compile ``model`` in each precision at (batch, seq) and compare with onnxruntime fp32."""
    import tvmdm
    from tvmdm.build.shapes import resolve_shapes
    from tvmdm.core.precision import MAX_REL_ERR
    from tvmdm.bench.inference import load_model

    proto = load_model(model)
    out = {}
    for precision in precisions:
        compiled = tvmdm.compile(proto, target=target, shapes=resolve_shapes(model, None, batch, seq),
                                 precision=precision)
        inputs = tvmdm.random_inputs(compiled, batch=batch, seq=seq)
        rel = max(o.max_rel_err for o in compiled.check(inputs).outputs)  # vs onnxruntime fp32
        bound = MAX_REL_ERR.get(precision, 1e-4)
        out[precision] = {"max_rel_err": rel, "bound": bound, "ok": rel <= bound,
                          "compile_s": round(sum(compiled.timings.values()), 2),
                          "tuned_kernels": len(compiled.tuned_kernels), "hand_kernels": len(compiled.hand_kernels),
                          "kernels": len(compiled.kernels)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmdm.bench.gpu_run", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for the JSON, plot, log and tuning database")
    parser.add_argument("--model", default="bert-base-layer")
    parser.add_argument("--batch", type=int, help="default: the model's")
    parser.add_argument("--seq", type=int, help="default: the model's")
    parser.add_argument("--arch", default="sm_90", help="CUDA arch (default sm_90: H100/H200)")
    parser.add_argument("--budget", type=float, default=480, help="wall-clock seconds for everything (default 480)")
    parser.add_argument("--reserve", type=float, default=0.15, help="share of the budget kept for the tuned "
                        "benchmark after tuning (default 0.15)")
    parser.add_argument("--trials", type=int, default=400, help="most tuning trials (the deadline usually ends it)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    log = _Log(os.path.join(args.out, "gpu_run.log"))
    from tvmdm import models
    from tvmdm.bench.inference import run_bench
    from tvmdm.bench.plot import plot_bench
    from tvmdm.bench.training import run_train_bench

    dims = models.default_dims(args.model) if args.model in models.DEFAULT_MODELS else {"batch": 1, "seq": 128}
    batch, seq = args.batch or dims["batch"], args.seq or dims["seq"]
    target, fallback = pick_target(args.arch)
    gpu = fallback is None
    precisions = ("fp32", "fp16") if gpu else ("fp32",)
    log(f"gpu_run: {args.model} batch {batch} seq {seq} on {target}; budget {args.budget:.0f} s")
    if fallback:
        log(f"NOTE: {fallback}")
    steps = Steps(args.out, log, {"model": args.model, "shapes": {"batch": batch, "seq": seq}, "target": target,
                                  "budget_s": args.budget, "fallback": fallback, "precisions": list(precisions)})
    per_system = lambda share: max(2.0, min(20.0, left() * share))  # noqa: E731 - seconds per timed system
    steps.run("check", lambda: check_precisions(args.model, target, precisions, batch, seq))
    bench = steps.run("bench", lambda: run_bench(
        args.model, batch=batch, seq=seq, target=target, precisions=precisions, untuned=False, kernels=False,
        torch_compile=True, max_seconds=per_system(0.02), out=log))
    if bench:
        plot_bench(bench, os.path.join(args.out, "gpu_run.png"))
    steps.run("train", lambda: run_train_bench(
        args.model, batch=batch, seq=seq, target=target, precisions=precisions, torch_compile=False,
        max_seconds=per_system(0.02), out=log))
    logs = os.path.join(args.out, "tuning_logs")
    steps.run("tune", lambda: tune_with_deadline(args.model, logs, target, args.trials, batch, seq,
                                                  left() - args.budget * args.reserve, log,
                                                  first_batch_grace=args.budget * args.reserve / 2))
    tuned = steps.run("tuned", lambda: run_bench(
        args.model, batch=batch, seq=seq, target=target, untuned=True, torch=False, ort_optimized=False,
        kernels=False, tuning_logs=logs, max_seconds=max(2.0, min(20.0, left() / 8)), out=log))
    if tuned:
        plot_bench(tuned, os.path.join(args.out, "gpu_run.png"))
    steps.result["wall_s"] = round(time.perf_counter() - start, 1)
    steps._write()
    failed = [name for name, record in steps.result["steps"].items() if "error" in record]
    log(f"wrote gpu_run.json, gpu_run.png in {args.out} after {time.perf_counter() - start:.0f} s"
        + (f"; failed steps: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
