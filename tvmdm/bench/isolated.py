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

from tvmdm.core.errors import Disagreement


@dataclasses.dataclass
class Job:
    """One system. Inference: ``kind`` "tvmdm" (spec: artifact), "onnxruntime" (model, threads, providers) or
    "torch" (model_name, model, threads, compile, device, precision). A training step: "tvmdm-train" (spec:
    step, an exported TrainStep: its path, or in this process the TrainStep), "torch-train" (as "torch", plus
    lr and autocast) or "hf-train" (a transformers classifier: family, size, threads, lr, autocast, compile);
    any of them ``loss_steps``: how many steps' losses to return before timing (default 2)."""
    kind: str
    spec: dict


def run_jobs(jobs: dict[str, Job], feeds: dict, reference: list | None = None, *, min_runs: int,
             max_seconds: float, relative: dict | None = None, references: dict | None = None,
             timeout_s: float = 900.0) -> dict[str, dict]:
    """Each job in a process of its own, in order: name -> {"seconds": [...]} plus, for inference,
    "max_abs_err" vs ``reference`` (onnxruntime's outputs; Disagreement naming the first system that
    disagrees, as check_agreement), for a training step "losses" (its first two steps, before timing).
    ``references``: name -> (whose outputs, the outputs) for the systems checked against other outputs (int8
    systems against onnxruntime on the int8 file)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="tvmdm-bench-") as tmp:
        np.savez(os.path.join(tmp, "feeds.npz"), **feeds)
        np.savez(os.path.join(tmp, "reference.npz"), *(reference or []))
        for name, job in jobs.items():
            path = os.path.join(tmp, f"job{len(results)}.json")
            against, reference_file = "onnxruntime", "reference.npz"
            if name in (references or {}):
                against, outputs = references[name]
                reference_file = f"reference{len(results)}.npz"
                np.savez(os.path.join(tmp, reference_file), *outputs)
            with open(path, "w") as f:
                json.dump({"name": name, "kind": job.kind, "spec": job.spec, "dir": tmp, "min_runs": min_runs,
                           "max_seconds": max_seconds, "max_rel_err": (relative or {}).get(name),
                           "reference": reference_file, "against": against}, f)
            # a tvmdm model runs as deployed: TVM's runtime library alone (faster to start, no compiler); a
            # training step's module imports Relax (tvmdm.train.step), which needs the compiler library
            env = dict(os.environ, TVM_USE_RUNTIME_LIB="1") if job.kind == "tvmdm" else None
            done = subprocess.run([sys.executable, "-m", "tvmdm.bench.isolated", path], capture_output=True,
                                  text=True, timeout=timeout_s, env=env)
            results[name] = _result(path + ".out", name, done)
            if "disagrees" in results[name]:
                raise Disagreement(results[name]["disagrees"])
    return results


def _result(path: str, name: str, done) -> dict:
    if done.returncode == 0 and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    tail = "\n".join((done.stderr or "").strip().splitlines()[-15:])
    raise RuntimeError(f"benchmark process for {name} failed (exit {done.returncode}):\n{tail}")


def _torch_reference(spec: dict):
    import onnx
    import torch

    from tvmdm.models.torch_reference import TorchReference

    torch.set_num_threads(spec["threads"])
    reference = TorchReference(spec["model_name"], onnx.load(spec["model"]), device=spec.get("device", "cpu"),
                               precision=spec.get("precision", "fp32"))
    return reference.compile() if spec.get("compile") else reference


def _runner(kind: str, spec: dict, feeds: dict):
    """What one call of the system is: run(feeds) for inference, step() -> loss for a training step."""
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
        return _torch_reference(spec).run
    if kind == "tvmdm-train":
        import tvmdm

        # an exported step's path, or (in_process) the TrainStep itself
        step = tvmdm.load_train_step(spec["step"]) if isinstance(spec["step"], (str, os.PathLike)) else spec["step"]
        return lambda: step.step(feeds)
    if kind == "hf-train":  # a transformers classifier of tvmdm.models.hf_export, as its export was made
        import torch

        from tvmdm.models import hf_export
        from tvmdm.models.torch_reference import hf_classifier_step

        torch.set_num_threads(spec["threads"])
        model = hf_export.without_dropout(hf_export.tiny_model(spec["family"], size=spec["size"]))
        inputs = {k: v for k, v in feeds.items() if k != "labels"}
        return hf_classifier_step(model, inputs, feeds["labels"], spec["lr"], autocast=spec.get("autocast"),
                                  compile=spec.get("compile", False))
    if kind == "torch-train":
        from tvmdm.models.torch_reference import torch_step

        inputs = {k: v for k, v in feeds.items() if k != "labels"}
        return torch_step(_torch_reference(spec), inputs, feeds["labels"], spec["lr"], autocast=spec.get("autocast"))
    raise ValueError(f"unknown benchmark job kind {kind!r}")


def train_result(step, loss_steps: int, min_runs: int, max_seconds: float) -> dict:
    """A training step's losses over ``loss_steps`` steps from the same start (the caller compares them), then
    its seconds per step."""
    from tvmdm.bench.timing import time_until_stable

    return {"losses": [step() for _ in range(loss_steps)],
            "seconds": time_until_stable(step, warmup=1, min_runs=min_runs, max_seconds=max_seconds)}


def in_process(job: Job, feeds: dict, min_runs: int, max_seconds: float) -> dict:
    """A training job's train_result in this process (no isolation: for checks of its losses, not timings)."""
    return train_result(_runner(job.kind, job.spec, feeds), job.spec.get("loss_steps", 2), min_runs, max_seconds)


def main(path: str) -> int:
    from tvmdm.bench.timing import check_agreement, time_until_stable
    from tvmdm.bench.without_amx import deny_tile_state_if_asked

    tile_state_denied = deny_tile_state_if_asked()  # before any library asks for the tile state

    with open(path) as f:
        job = json.load(f)
    name = job["name"]
    with np.load(os.path.join(job["dir"], "feeds.npz")) as data:
        feeds = {k: data[k] for k in data.files}
    with np.load(os.path.join(job["dir"], job.get("reference", "reference.npz"))) as data:
        reference = [data[f"arr_{i}"] for i in range(len(data.files))]
    run = _runner(job["kind"], job["spec"], feeds)
    if job["kind"].endswith("-train"):
        result = train_result(run, job["spec"].get("loss_steps", 2), job["min_runs"], job["max_seconds"])
    else:
        relative = {name: job["max_rel_err"]} if job["max_rel_err"] is not None else {}
        try:
            errors = check_agreement({name: run}, feeds, reference, relative=relative,
                                     against=job.get("against", "onnxruntime"))
        except Disagreement as err:
            result = {"disagrees": str(err)}
        else:
            times = time_until_stable(lambda: run(feeds), min_runs=job["min_runs"], max_seconds=job["max_seconds"])
            result = {"max_abs_err": errors[name], "seconds": times}
    with open(path + ".out", "w") as f:
        json.dump(dict(result, tile_state_denied=tile_state_denied), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
