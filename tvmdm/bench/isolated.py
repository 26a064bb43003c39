"""Each benchmarked system checked and timed in a process of its own.

In one process the systems disturb each other: TVM's thread pool and PyTorch's OpenMP threads keep spinning
after their work, so whichever runs next shares the cores with them (measured on a 2-core VM: a 256x256 torch
matmul took 0.39 ms after a tvmdm run instead of 0.24; on another VM 7-10 ms, shown as "2522x onnxruntime").
Passive waiting would slow every system instead (0.41 ms for the same matmul). So the parent builds each
system's recipe (a tvmdm artifact, an ONNX file for onnxruntime, a model name for PyTorch), writes the inputs
and onnxruntime's outputs once, and a fresh process per system loads it, checks its outputs against them and
times it with its own defaults (``python -m tvmdm.bench.isolated JOB``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


@dataclasses.dataclass
class Job:
    """One system: ``kind`` "tvmdm" (spec: artifact), "onnxruntime" (model, threads, providers) or "torch"
    (model_name, model, threads, compile, device, precision)."""
    kind: str
    spec: dict


def run_jobs(jobs: dict[str, Job], feeds: dict, reference: list, *, min_runs: int, max_seconds: float,
             relative: dict, timeout_s: float = 900.0) -> tuple[dict, dict[str, list[float]]]:
    """(max abs error vs the reference, seconds per call) of every job, each in its own process, in order.
    AssertionError naming the first system whose outputs disagree (as check_agreement)."""
    errors, seconds = {}, {}
    with tempfile.TemporaryDirectory(prefix="tvmdm-bench-") as tmp:
        np.savez(os.path.join(tmp, "feeds.npz"), **feeds)
        np.savez(os.path.join(tmp, "reference.npz"), *reference)
        for name, job in jobs.items():
            path = os.path.join(tmp, f"job{len(seconds)}.json")
            with open(path, "w") as f:
                json.dump({"name": name, "kind": job.kind, "spec": job.spec, "dir": tmp, "min_runs": min_runs,
                           "max_seconds": max_seconds, "max_rel_err": relative.get(name)}, f)
            # a tvmdm system runs as deployed: TVM's runtime library alone (faster to start, no compiler)
            env = dict(os.environ, TVM_USE_RUNTIME_LIB="1") if job.kind == "tvmdm" else None
            done = subprocess.run([sys.executable, "-m", "tvmdm.bench.isolated", path], capture_output=True,
                                  text=True, timeout=timeout_s, env=env)
            result = _result(path + ".out", name, done)
            if "disagrees" in result:
                raise AssertionError(result["disagrees"])
            errors[name], seconds[name] = result["max_abs_err"], result["seconds"]
    return errors, seconds


def _result(path: str, name: str, done) -> dict:
    if done.returncode == 0 and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    tail = "\n".join((done.stderr or "").strip().splitlines()[-15:])
    raise RuntimeError(f"benchmark process for {name} failed (exit {done.returncode}):\n{tail}")


def _runner(kind: str, spec: dict):
    if kind == "tvmdm":
        import tvmdm

        return tvmdm.load(spec["artifact"]).run
    if kind == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = spec["threads"]
        session = ort.InferenceSession(spec["model"], options, providers=spec.get("providers",
                                                                                   ["CPUExecutionProvider"]))
        names = [o.name for o in session.get_outputs()]
        return lambda feeds: session.run(names, feeds)
    if kind == "torch":
        import onnx
        import torch

        from tvmdm.models.torch_reference import TorchReference

        torch.set_num_threads(spec["threads"])
        reference = TorchReference(spec["model_name"], onnx.load(spec["model"]), device=spec.get("device", "cpu"),
                                   precision=spec.get("precision", "fp32"))
        return (reference.compile() if spec.get("compile") else reference).run
    raise ValueError(f"unknown benchmark job kind {kind!r}")


def main(path: str) -> int:
    from tvmdm.bench.timing import check_agreement, time_until_stable

    with open(path) as f:
        job = json.load(f)
    name = job["name"]
    with np.load(os.path.join(job["dir"], "feeds.npz")) as data:
        feeds = {k: data[k] for k in data.files}
    with np.load(os.path.join(job["dir"], "reference.npz")) as data:
        reference = [data[f"arr_{i}"] for i in range(len(data.files))]
    run = _runner(job["kind"], job["spec"])
    relative = {name: job["max_rel_err"]} if job["max_rel_err"] is not None else {}
    try:
        errors = check_agreement({name: run}, feeds, reference, relative=relative)
    except AssertionError as err:
        result = {"disagrees": str(err)}
    else:
        times = time_until_stable(lambda: run(feeds), min_runs=job["min_runs"], max_seconds=job["max_seconds"])
        result = {"max_abs_err": errors[name], "seconds": times}
    with open(path + ".out", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
