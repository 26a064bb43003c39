"""Whole BERT from real exports, measured side by side: ``python -m tvmdm.bench.hf [--size base]``.

A transformers ``BertModel`` and ``BertForSequenceClassification`` built from a config with seeded weights
(``tvmdm.hf_export``; "base" is bert-base-uncased's shape: 12 layers, 110M parameters), exported by both torch
exporters with dynamic (batch, seq) axes, then, each step's result written to the JSON as soon as it ends:

- compile: ``tvmdm.compile`` with symbolic shapes and with bound ones, each in a fresh process (seconds, peak
  resident memory), for each exporter's file;
- latency at each (batch, seq): tvmdm compiled for that size, one symbolic tvmdm module serving every size,
  onnxruntime, onnxruntime after its transformers optimizer, PyTorch eager (the very module exported); every
  system checked against onnxruntime first;
- memory: peak resident memory of a fresh process that loads and runs the model (tvmdm's exported artifact, as
  a deployment runs it: TVM's runtime library alone, no torch; vs an onnxruntime session on the ONNX file);
- train: a BertForSequenceClassification step (cross-entropy, AdamW) of tvmdm vs PyTorch eager from the same
  weights, each in a process of its own, the losses of the first steps compared, then timed; ``--precision
  fp32,bf16`` adds tvmdm[bf16] and PyTorch under bf16 autocast, ``--torch-compile`` torch.compile;
- analyze: flops and bytes per kernel class, stock vs paper fusion.

The same code runs on the 12-layer tiny twin (``--size tiny-12``) in the test suite.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

from tvmdm.bench.inference import check_and_time, format_table, summarize

SIZES = {"base": [(1, 128), (8, 128), (1, 512)], "tiny-12": [(1, 16), (2, 8), (1, 40)]}
TRAIN_SIZE = {"base": (8, 128), "tiny-12": (2, 8)}
EXPORTERS = ("legacy", "dynamo")
LR = 1e-4


def export_models(size: str, out_dir: str, out=print, families=("bert", "bert-seqcls")) -> dict:
    """{family: {exporter: path}} ("bert", "bert-seqcls"): dynamic-axes exports, opset 17 (legacy) and 18
    (dynamo), made once (an existing file is reused)."""
    from tvmdm.models import hf_export

    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for family in families:
        model = hf_export.tiny_model(family, size=size)
        for exporter in EXPORTERS:
            path = os.path.join(out_dir, f"{family}-{size}-{exporter}.onnx")
            if not os.path.exists(path):
                t0 = time.perf_counter()
                hf_export.export(family, path, dynamo=exporter == "dynamo", dynamic=True,
                                 opset=18 if exporter == "dynamo" else 17, model=model)
                out(f"exported {path} ({os.path.getsize(path) / 1e6:.0f} MB, {time.perf_counter() - t0:.0f} s)")
            paths.setdefault(family, {})[exporter] = path
    return paths


def _probe(code: str, *args: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh Python process (``env`` added to the environment); it prints one JSON line last."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        raise RuntimeError(f"probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The process's peak resident memory in MiB: VmHWM belongs to its own address space (ru_maxrss would report the
# forking parent's peak: Linux carries it across exec).
_PEAK = "peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024"

_COMPILE = f"""
import json, sys, time
import tvmdm
path, shapes = sys.argv[1], json.loads(sys.argv[2])
t0 = time.perf_counter()
compiled = tvmdm.compile(path, shapes=shapes or None)
seconds = time.perf_counter() - t0
if len(sys.argv) > 3:
    compiled.export(sys.argv[3])
{_PEAK}
print(json.dumps({{"seconds": seconds, "peak_rss_mb": peak, "stages": compiled.timings,
                  "kernels": len(compiled.kernels), "hand": len(compiled.hand_kernels),
                  "tuned": len(compiled.tuned_kernels)}}))
"""

# Load the model (sys.argv[1]) as ``load`` says, run it 3 times on the feeds in sys.argv[2], print the peak.
_RUN = """
import json, sys
import numpy as np
{load}
feeds = dict(np.load(sys.argv[2]))
for _ in range(3):
    run(feeds)
{peak}
print(json.dumps({{"peak_rss_mb": peak}}))
"""
# A deployment: TVM's runtime library alone (TVM_USE_RUNTIME_LIB, set by run_memory) and no torch (tvm_ffi
# imports it when installed: 180 MB; the core dependencies do not include it).
_RUN_TVMDM = _RUN.format(peak=_PEAK, load="""
sys.modules["torch"] = None
import tvmdm
run = tvmdm.load(sys.argv[1]).run""")
_RUN_ORT = _RUN.format(peak=_PEAK, load="""
import onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
run = lambda feeds: session.run(None, feeds)""")


def bound_shapes(path: str, batch: int, seq: int) -> dict:
    from onnx_import.importer import onnx_input_specs
    from onnx_import.loader import load_model_proto
    from tvmdm.runtime.inputs import bind_batch_seq

    return bind_batch_seq(onnx_input_specs(load_model_proto(path)[0]), {}, batch, seq)


def compile_costs(paths: dict, batch: int, seq: int, out=print) -> list[dict]:
    """Compile time and peak memory, symbolic and bound, of each exporter's BertModel, each in a fresh process."""
    rows = []
    for exporter, path in paths.items():
        for kind, shapes in (("symbolic", {}), ("bound", bound_shapes(path, batch, seq))):
            found = _probe(_COMPILE, path, json.dumps(shapes))
            rows.append(dict(exporter=exporter, shapes=kind, **found))
            out(f"  compile {exporter} {kind}: {found['seconds']:.1f} s, peak {found['peak_rss_mb']:.0f} MB, "
                f"{found['hand']} + {found['tuned']} of {found['kernels']} kernels by hand / from logs")
    return rows


def sample_feeds(family: str, model, batch: int, seq: int) -> dict:
    from tvmdm.models import hf_export

    return hf_export.sample_inputs(family, batch=batch, seq=seq, vocab=hf_export.vocab_size(model))


def _torch_runner(model, threads: int):
    import torch

    torch.set_num_threads(threads)

    def run(feeds):
        with torch.inference_mode():
            return [model(**{k: torch.from_numpy(v) for k, v in feeds.items()})[0].numpy()]

    return run


def latencies(path: str, model, sizes, *, min_runs: int = 5, max_seconds: float = 30.0, out=print) -> list[dict]:
    """At each (batch, seq): every system checked against onnxruntime, then timed (median, p10, p90)."""
    import tvmdm
    from tvmdm.bench.inference import bert_optimized, ort_runner
    from tvmdm.build.compiled import ort_session
    from onnx_import.loader import load_model_proto
    from tvmdm.core.target import num_cores

    threads = num_cores()
    proto = load_model_proto(path)[0]
    symbolic = tvmdm.compile(path)
    ort = ort_runner(ort_session(proto, threads), symbolic.output_names)
    ort_opt = ort_runner(ort_session(bert_optimized(proto, None), threads), symbolic.output_names)
    torch_run = _torch_runner(model, threads)
    rows = []
    for batch, seq in sizes:
        bound = tvmdm.compile(path, shapes=bound_shapes(path, batch, seq))
        systems = {"onnxruntime": ort, "onnxruntime-bert-opt": ort_opt, "tvmdm": bound.run,
                   "tvmdm[symbolic]": symbolic.run, "torch-eager": torch_run}
        feeds = sample_feeds("bert", model, batch, seq)
        agreement, timings = check_and_time(systems, feeds, ort(feeds), min_runs=min_runs, max_seconds=max_seconds,
                                            out=lambda line: None)
        out(f"batch {batch}, seq {seq}:")
        for line in format_table(timings):
            out("  " + line)
        rows.append({"batch": batch, "seq": seq, "max_abs_err_vs_onnxruntime": agreement,
                     "timings": [dataclasses.asdict(t) for t in timings]})
    return rows


def run_memory(path: str, model, batch: int, seq: int, work_dir: str, out=print) -> dict:
    """Peak RSS of a fresh process that loads and runs the model 3 times: tvmdm's artifact (bound shapes, made
    by a compile in its own process) vs onnxruntime on the ONNX file."""
    feeds_path = os.path.join(work_dir, f"feeds-{batch}x{seq}.npz")
    np.savez(feeds_path, **sample_feeds("bert", model, batch, seq))
    artifact = os.path.join(work_dir, f"bert-{batch}x{seq}.tvmdm")
    _probe(_COMPILE, path, json.dumps(bound_shapes(path, batch, seq)), artifact)
    found = {"tvmdm": _probe(_RUN_TVMDM, artifact, feeds_path, env={"TVM_USE_RUNTIME_LIB": "1"})["peak_rss_mb"],
             "onnxruntime": _probe(_RUN_ORT, path, feeds_path)["peak_rss_mb"]}
    found["tvmdm_over_onnxruntime"] = found["tvmdm"] / found["onnxruntime"]
    out(f"  run memory at ({batch}, {seq}): tvmdm {found['tvmdm']:.0f} MB, onnxruntime {found['onnxruntime']:.0f} MB "
        f"({found['tvmdm_over_onnxruntime']:.2f}x)")
    return found


def train_step(path: str, model_size: str, batch: int, seq: int, *, precisions=("fp32",),
               torch_compile: bool = False, steps: int = 3, min_runs: int = 3, max_seconds: float = 60.0,
               isolated: bool = True, out=print) -> dict:
    """tvmdm's compiled step vs PyTorch eager on the exported BertForSequenceClassification (``model_size``'s
    seeded weights, the export's): cross-entropy, AdamW(lr=LR). tvmdm in each of ``precisions`` ("tvmdm" for
    fp32, "tvmdm[p]" else); PyTorch eager in fp32 and, for each reduced precision, under its autocast
    ("torch-eager[p]"); ``torch_compile`` adds torch.compile likewise. Each system in a process of its own
    (tvmdm.bench.isolated): the losses of ``steps`` steps from the same weights compared with PyTorch's fp32
    step (bench.training.check_training_agreement: fp32 within 1e-3, reduced precisions within 1e-2, and with
    PyTorch's autocast step in their precision within 1e-2), then timed. ``isolated=False``: every system in
    this process instead, the steps not exported (tests of the losses; its timings are disturbed, see
    tvmdm.bench.isolated)."""
    import tempfile

    import tvmdm
    from tvmdm.bench.isolated import Job, in_process, run_jobs
    from tvmdm.bench.training import check_against_autocast, check_training_agreement
    from tvmdm.core.target import num_cores
    from tvmdm.models import hf_export

    reduced = [p for p in precisions if p != "fp32"]
    compile_seconds = {}
    with tempfile.TemporaryDirectory(prefix="tvmdm-bench-hf-train-") as tmp:
        jobs = {}
        for precision in precisions:
            t0 = time.perf_counter()
            step = tvmdm.compile_train_step(path, loss="cross_entropy", optimizer=tvmdm.AdamW(lr=LR), batch=batch,
                                            seq=seq, precision=precision)
            name = "tvmdm" if precision == "fp32" else f"tvmdm[{precision}]"
            compile_seconds[name] = time.perf_counter() - t0
            jobs[name] = Job("tvmdm-train", {"step": step.export(os.path.join(tmp, f"{precision}.tar")) if isolated
                                             else step, "loss_steps": steps})
        torch_spec = {"family": "bert-seqcls", "size": model_size, "threads": num_cores(), "lr": LR,
                      "loss_steps": steps}
        for system, compiled in [("torch-eager", False)] + ([("torch-compile", True)] if torch_compile else []):
            jobs[system] = Job("hf-train", dict(torch_spec, compile=compiled))
            for precision in reduced:
                jobs[f"{system}[{precision}]"] = Job("hf-train", dict(torch_spec, compile=compiled, autocast=precision))
        # the vocabulary from the config, not from a model built only to read it (110M parameters at base)
        feeds = hf_export.sample_inputs("bert-seqcls", batch=batch, seq=seq,
                                        vocab=hf_export.config("bert-seqcls", model_size).vocab_size)
        labels = np.random.default_rng(1).integers(0, hf_export.NUM_LABELS, size=batch).astype(np.int64)
        for name in jobs:
            out(f"  {name} training step{' (a process of its own)' if isolated else ''} ...")
        batch_feeds = dict(feeds, labels=labels)
        results = run_jobs(jobs, batch_feeds, min_runs=min_runs, max_seconds=max_seconds) if isolated else \
            {name: in_process(job, batch_feeds, min_runs, max_seconds) for name, job in jobs.items()}
    losses = {name: r["losses"] for name, r in results.items()}
    out(f"  losses of {steps} steps: " + ", ".join(f"{name} {[round(x, 6) for x in v]}" for name, v in losses.items()))
    check_training_agreement(losses, reference="torch-eager")
    check_against_autocast(losses, reduced)
    timings = [summarize(name, r["seconds"]) for name, r in results.items()]
    by_name = {t.system: t.median_ms for t in timings}
    for t in timings:
        t.vs_torch_eager = t.median_ms / by_name["torch-eager"]
    for line in format_table(timings, ratio="vs_torch_eager", label="vs eager"):
        out("  " + line)
    result = {"batch": batch, "seq": seq, "compile_seconds": compile_seconds, "losses": losses,
              "timings": [dataclasses.asdict(t) for t in timings]}
    if "tvmdm" in losses:
        result["max_rel_loss_gap"] = max(abs(a - b) / abs(b) for a, b in zip(losses["tvmdm"], losses["torch-eager"]))
        result["torch_eager_over_tvmdm"] = by_name["torch-eager"] / by_name["tvmdm"]
    if "bf16" in reduced:  # the #26 comparison: PyTorch eager under bf16 autocast against tvmdm's bf16 step
        result["torch_eager_bf16_over_tvmdm_bf16"] = by_name["torch-eager[bf16]"] / by_name["tvmdm[bf16]"]
        out(f"  tvmdm[bf16] vs torch-eager[bf16] (autocast): {result['torch_eager_bf16_over_tvmdm_bf16']:.2f}x faster")
    return result


def data_movement(path: str, batch: int, seq: int, out=print) -> dict:
    """``tvmdm analyze`` of the whole model at (batch, seq): totals by class, stock vs paper fusion."""
    import tvmdm
    from tvmdm.analysis.report import compare

    shapes = bound_shapes(path, batch, seq)
    reports = [tvmdm.analyze(path, fusion=fusion, shapes=shapes) for fusion in ("tvm", "paper")]
    for report in reports:
        out(f"  {report.fusion}: {len(report.rows)} kernel calls, {report.total_bytes / 1e6:.0f} MB, "
            f"{report.total_flops / 1e9:.1f} GFLOP")
    return {"by_class": {r.fusion: r.totals() for r in reports}, "compare": compare(reports)}


class Results:
    """The JSON of a run, rewritten as each step ends (a run cut short keeps what it measured); the steps of an
    earlier run into the same file stay unless measured again."""

    def __init__(self, path: str, size: str):
        self.path = path
        self.data = {}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)
            if self.data.get("size") != size:
                self.data = {}
        self.data.update({"schema": "tvmdm-bench-hf/1", "size": size})

    def add(self, key: str, value) -> None:
        self.data[key] = value
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)


def run(size: str = "base", out_dir: str = "out/bench_hf", steps=("compile", "latency", "memory", "train",
                                                                    "analyze"), out=print, sizes=None,
        precisions=("fp32",), torch_compile: bool = False) -> dict:
    """The steps named, each result written to the JSON as it ends; ``sizes``: the (batch, seq) of the latency
    and memory steps (default: the size's SIZES); ``precisions`` and ``torch_compile``: the train step's
    systems (train_step). Only the exports the steps read are made (the classifier's for "train")."""
    from tvmdm.models import hf_export
    from tvmdm.bench.machine import machine_info
    from tvmdm.core.target import num_cores

    os.makedirs(out_dir, exist_ok=True)
    results = Results(os.path.join(out_dir, f"bench_hf-{size}.json"), size)
    results.add("machine", machine_info(num_cores()))
    paths = export_models(size, out_dir, out, ("bert", "bert-seqcls") if "train" in steps else ("bert",))
    bert = hf_export.tiny_model("bert", size=size)  # the same seeded weights the exports carry
    batch, seq = TRAIN_SIZE[size]
    sizes = SIZES[size] if sizes is None else sizes
    step_runs = {
        "compile": lambda: compile_costs(paths["bert"], batch, seq, out),
        "latency": lambda: {e: latencies(p, bert, sizes, out=out) for e, p in paths["bert"].items()},
        "memory": lambda: {f"{b}x{s}": run_memory(paths["bert"]["legacy"], bert, b, s, out_dir, out)
                           for b, s in sizes},
        "train": lambda: {e: train_step(p, size, batch, seq, precisions=precisions, torch_compile=torch_compile,
                                        out=out) for e, p in paths["bert-seqcls"].items()},
        "analyze": lambda: data_movement(paths["bert"]["legacy"], batch, seq, out),
    }
    for name in steps:
        out(f"== {name}")
        results.add(name, step_runs[name]())
    out(f"wrote {results.path}")
    return results.data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmdm.bench.hf", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--out", default="out/bench_hf", help="folder for the exports, artifacts and the JSON")
    parser.add_argument("--steps", default="compile,latency,memory,train,analyze")
    parser.add_argument("--precision", default="fp32",
                        help="the train step's precisions, e.g. fp32,bf16 (bf16: tvmdm[bf16] and torch-eager[bf16], "
                             "PyTorch under bf16 autocast)")
    parser.add_argument("--torch-compile", action="store_true", help="the train step under torch.compile too")
    args = parser.parse_args(argv)
    run(args.size, args.out, tuple(s for s in args.steps.split(",") if s),
        precisions=tuple(p for p in args.precision.split(",") if p), torch_compile=args.torch_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
