"""The GPU machine's half of a lent-GPU session: run what ``gpu_prepare`` compiled, with TVM's runtime alone.

    TVM_USE_RUNTIME_LIB=1 python -m tvmdm.bench.gpu_run RUN_DIR OUT_DIR [--budget 540] [--no-torch-compile]
    (scripts/device/run_gpu.sh unpacks RUN_DIR/runtime.tar.xz and calls this)

1. preflight, in seconds: the CUDA runtime found and loaded (libcudart before TVM's CUDA library, which TVM
   would otherwise fail to load without a word), ``tvm.cuda(0).exist``, torch's CUDA, and the preflight
   model's kernels run on the device and agree with PyTorch. Any of it failing ends the run (exit 3) before a
   minute is spent.
2. each configuration of the plan, in order, while the budget holds (the rest is recorded as skipped):
   weights rebuilt from the model's seed and checked against the digest taken where it was compiled; outputs
   (or two training steps' losses) against PyTorch on the GPU; then timings, device-side first (arrays
   already on the device: TVM's time evaluator, CUDA events for PyTorch), then end to end (numpy in and out).
Each result is in OUT_DIR/gpu_run.json as soon as it is known; OUT_DIR/gpu_run.log has every line.
``--device cpu`` runs the same path on the CPU (for a module compiled for llvm): how it is tested without a GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys
import time

import numpy as np

from tvmdm.bench import gpu_plan
from tvmdm.bench.gpu_plan import GpuConfig

CUDART = "libcudart.so.13"  # what TVM 0.27's libtvm_runtime_cuda.so links against
PREFLIGHT_EXIT = 3


class PreflightError(RuntimeError):
    pass


def cudart_candidates() -> list[str]:
    """Where the CUDA runtime library may be: the toolkit, then the wheels PyTorch ships it in."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    found = [os.path.join(r, sub, CUDART) for r in roots if r for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    for site in sys.path:
        found += glob.glob(os.path.join(site, "nvidia", "*", "lib", CUDART))  # nvidia/cuda_runtime, nvidia/cu13
    return [p for p in dict.fromkeys(found) if os.path.isfile(p)]


DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")


def _load_first(paths) -> str | None:
    """The first of ``paths`` that loads (RTLD_GLOBAL: later libraries find it by its soname), or None."""
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
        except OSError:
            continue
    return None


def load_cuda_runtime() -> dict:
    """Load libcudart and the driver (from the loader path, else a known place), then TVM's CUDA runtime
    library; PreflightError saying which one failed and why."""
    import tvm
    from tvm.base import _LOADED_LIBS

    candidates = [CUDART, *cudart_candidates()]
    cudart = _load_first(candidates)
    if cudart is None:
        raise PreflightError(f"{CUDART} not found (tried {candidates}); set CUDA_HOME or LD_LIBRARY_PATH")
    driver = _load_first(["libcuda.so.1", *(os.path.join(d, "libcuda.so.1") for d in DRIVER_DIRS)])
    if driver is None:
        raise PreflightError("libcuda.so.1 (the NVIDIA driver) not found: no GPU driver on this machine")
    runtime_dir = os.path.dirname(os.path.realpath(_LOADED_LIBS["tvm_runtime"]._name))
    cuda_lib = os.path.join(runtime_dir, "libtvm_runtime_cuda.so")
    try:
        ctypes.CDLL(cuda_lib, mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise PreflightError(f"TVM's CUDA runtime {cuda_lib} does not load: {err}") from None
    if not tvm.cuda(0).exist:
        raise PreflightError("TVM's CUDA runtime loaded, but tvm.cuda(0) does not exist: no usable GPU or driver")
    dev = tvm.cuda(0)
    return {"cudart": cudart, "driver": driver, "tvm_cuda": cuda_lib, "device": dev.device_name,
            "compute": dev.compute_version, "multiprocessors": dev.multi_processor_count}


def onnxruntime_on_gpu() -> str:
    """Whether onnxruntime can be a GPU baseline here, or why not (its GPU wheel, ~200 MB with its CUDA
    libraries, is over what one device call carries, so only an installed one counts)."""
    try:
        import onnxruntime
    except ImportError:
        return "not installed"
    providers = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" in providers:
        return f"{onnxruntime.__version__} with CUDAExecutionProvider (not timed by this run yet)"
    return (f"{onnxruntime.__version__} has no CUDAExecutionProvider here ({', '.join(providers)}): "
            "onnxruntime-gpu is not installed and too big to carry")


def runtime_only() -> dict:
    """Whether this process holds TVM's runtime only (what a deployment has), and what it loaded."""
    import tvm
    from tvm import base

    return {"runtime_only": bool(base._RUNTIME_ONLY), "libraries": sorted(base._LOADED_LIBS),
            "tvm": os.path.dirname(tvm.__file__)}


def load_config(run_dir: str, name: str):
    """(config, runner, the model's ONNX proto) of a prepared configuration: library loaded, weights rebuilt
    from the model's seed (once: PyTorch's twins take the same proto) and checked."""
    from tvm import runtime

    from tvmdm import models
    from tvmdm.bench.gpu_prepare import initializers
    from tvmdm.runtime.artifact import runner_from_parts
    from tvmdm.runtime.train_step import train_step_from_parts

    with open(os.path.join(run_dir, f"{name}.json")) as f:
        entry = json.load(f)
    config = GpuConfig.from_json(entry["config"])
    recipe = entry["weights"]
    proto = models.default_model(recipe["model"])
    weights = initializers(proto)
    chosen = {n: weights[n] for n in recipe["names"]}
    if gpu_plan.weights_digest(chosen) != recipe["sha256"]:
        raise RuntimeError(f"{name}: the weights rebuilt here from {recipe['model']}'s seed differ from those it "
                           "was compiled with (numpy or onnx changed how they are drawn?)")
    lib = runtime.load_module(os.path.join(run_dir, entry["library"]))
    if config.train:
        state = {f"weights/{n}": v for n, v in chosen.items()}
        state |= {f"adam_{k}/{n}": np.zeros_like(v) for k in "mv" for n, v in chosen.items()}
        state["step"] = np.array(0, np.int64)
        return config, train_step_from_parts(entry["manifest"], lib, state, name), proto
    return config, runner_from_parts(entry["manifest"], lib, chosen, name), proto


def device_times(fn, repeat: int, device: str) -> list[float]:
    """Seconds per call of ``fn`` (torch work), measured with CUDA events on a GPU, after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    if device != "cuda":
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def ms(times) -> float:
    return round(float(np.median(times)) * 1e3, 4)


def run_inference(config: GpuConfig, runner, proto, device: str, repeat: int, torch_compile: bool) -> dict:
    """Outputs against PyTorch fp32 on the same device, then device-side and end-to-end medians (ms)."""
    import torch

    from tvmdm.bench.timing import time_until_stable
    from tvmdm.build.check import compare_outputs
    from tvmdm.core.precision import MAX_REL_ERR
    from tvmdm.models.torch_reference import TorchReference
    from tvmdm.runtime.inputs import random_inputs

    feeds = random_inputs(runner, batch=config.batch, seq=config.seq)
    fp32 = TorchReference(config.model, proto, device=device, precision="fp32")
    check = compare_outputs(runner.output_names[:1], runner.run(feeds)[:1], fp32.run(feeds), 1e-4, 1e-4)
    rel = check.outputs[0].max_rel_err
    bound = MAX_REL_ERR.get(config.precision, 1e-4)
    result = {"max_rel_err": rel, "bound": bound, "ok": rel <= bound, "device_ms": {}, "end_to_end_ms": {}}
    result["device_ms"]["tvmdm"] = ms(runner.time(feeds, repeat=repeat))
    result["end_to_end_ms"]["tvmdm"] = ms(time_until_stable(lambda: runner.run(feeds), max_seconds=5))
    systems = {"torch-eager": "fp32", f"torch-eager[{config.precision}]": config.precision} \
        if config.precision != "fp32" else {"torch-eager": "fp32"}
    for name, precision in systems.items():
        ref = fp32 if precision == "fp32" else TorchReference(config.model, proto, device=device, precision=precision)
        compiled = torch_compile and config.compile_s and precision == config.precision
        variants = [(name, ref)] + ([(name.replace("eager", "compile"), TorchReference(
            config.model, proto, device=device, precision=precision).compile())] if compiled else [])
        for label, system in variants:
            inputs = system.torch_inputs(feeds)

            def call(system=system, inputs=inputs):
                with torch.inference_mode(), system._precision():
                    return system.forward(inputs)

            result["device_ms"][label] = ms(device_times(call, repeat, device))
            result["end_to_end_ms"][label] = ms(time_until_stable(lambda s=system: s.run(feeds), max_seconds=5))
    return result


def run_training(config: GpuConfig, step, proto, device: str, repeat: int) -> dict:
    """Two steps' losses against PyTorch's step (AMP for fp16) from the same weights, then step times (ms)."""
    from tvmdm.bench.timing import time_until_stable
    from tvmdm.core.training import BENCH_LR
    from tvmdm.models.torch_reference import TorchReference, torch_step
    from tvmdm.runtime.inputs import random_inputs

    feeds = random_inputs(step, batch=config.batch, seq=config.seq)
    labels = np.random.default_rng(1).standard_normal(step.target_spec.shape).astype(np.float32)
    batch = dict(feeds, labels=labels)
    ours = [step.step(batch) for _ in range(2)]
    autocast = "fp16" if config.precision == "fp16" else None
    torch_fn = torch_step(TorchReference(config.model, proto, device=device), feeds, labels, BENCH_LR,
                          autocast=autocast)
    theirs = [torch_fn() for _ in range(2)]
    rtol = 1e-2 if autocast else 1e-3
    agree = all(abs(a - b) <= rtol * abs(b) for a, b in zip(ours, theirs))
    label = f"torch-eager[{autocast}]" if autocast else "torch-eager"
    return {"losses": {"tvmdm": ours, label: theirs}, "rtol": rtol, "ok": agree,
            "device_ms": {"tvmdm": ms(step.time(batch, repeat=repeat)), label: ms(device_times(torch_fn, repeat, device))},
            "end_to_end_ms": {"tvmdm": ms(time_until_stable(lambda: step.step(batch), max_seconds=5))}}


class Report:
    """gpu_run.json, rewritten atomically after every part, and gpu_run.log, appended line by line."""

    def __init__(self, out_dir: str, header: dict):
        os.makedirs(out_dir, exist_ok=True)
        self.json_path = os.path.join(out_dir, "gpu_run.json")
        self.log_path = os.path.join(out_dir, "gpu_run.log")
        self.data = dict(header, configs={})
        self.write()

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def write(self) -> None:
        with open(self.json_path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(self.json_path + ".tmp", self.json_path)


def run_part(report: Report, key: str, fn) -> dict:
    """Run one part, its result or error recorded under ``key`` with its seconds; a failure does not stop the
    next part (a lease is too short to lose the rest to one)."""
    t0 = time.perf_counter()
    try:
        record = fn()
    except Exception as err:  # noqa: BLE001
        record = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
        report.log(f"{key} failed: {record['error'][:500]}")
    record["seconds"] = round(time.perf_counter() - t0, 1)
    report.data["configs"][key] = record
    report.write()
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmdm.bench.gpu_run", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="what gpu_prepare wrote (plan.json, NAME.so, NAME.json)")
    parser.add_argument("out", help="folder for gpu_run.json and gpu_run.log")
    parser.add_argument("--budget", type=float, default=gpu_plan.DEFAULT_BUDGET_S,
                        help=f"wall-clock seconds for everything (default {gpu_plan.DEFAULT_BUDGET_S})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per system (default 20)")
    parser.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with open(os.path.join(args.run_dir, "plan.json")) as f:
        plan_file = json.load(f)
    plan = [GpuConfig.from_json(c) for c in plan_file["plan"]]
    report = Report(args.out, {"device": args.device, "budget_s": args.budget, "arch": plan_file["arch"],
                               "prepared": plan_file["created"], "plan": [c.name for c in plan]})
    report.log(f"gpu_run: {len(plan)} configurations, budget {args.budget:.0f} s, device {args.device}")
    try:
        import torch

        found = runtime_only()
        if args.device == "cuda":
            found |= load_cuda_runtime()
            if not torch.cuda.is_available():
                raise PreflightError("torch sees no CUDA device (its baselines would run on the CPU)")
            found["torch"] = f"{torch.__version__} on {torch.cuda.get_device_name(0)}"
            found["onnxruntime"] = onnxruntime_on_gpu()
        report.data["preflight"] = found
        report.log(f"preflight: {found}")
        check = run_inference(*load_config(args.run_dir, plan_file["preflight"]), args.device, repeat=3,
                              torch_compile=False)
        report.data["preflight"]["check"] = check
        if not check["ok"]:
            raise PreflightError(f"the preflight model disagrees with PyTorch: max rel error {check['max_rel_err']:.2e}")
    except Exception as err:  # noqa: BLE001 - every preflight failure ends the run, said in the report
        report.data["preflight_error"] = f"{type(err).__name__}: {err}"
        report.write()
        report.log(f"PREFLIGHT FAILED after {time.perf_counter() - start:.1f} s: {err}")
        return PREFLIGHT_EXIT
    report.write()
    taken, left_out = gpu_plan.fits(plan, args.budget - (time.perf_counter() - start), args.torch_compile)
    report.data["skipped"] = {c.name: "over the budget" for c in left_out}
    for config in taken:
        left = args.budget - (time.perf_counter() - start)
        cost = gpu_plan.config_cost(config, args.torch_compile)
        if left < cost:  # earlier parts took longer than expected
            report.data["skipped"][config.name] = f"{left:.0f} s left, expected {cost:.0f} s"
            continue
        report.log(f"== {config.name} ({left:.0f} s left)")

        def part(config=config):
            config, runner, proto = load_config(args.run_dir, config.name)
            if config.train:
                return run_training(config, runner, proto, args.device, args.repeat)
            return run_inference(config, runner, proto, args.device, args.repeat, args.torch_compile)

        record = run_part(report, config.name, part)
        report.log(f"{config.name}: {json.dumps({k: record.get(k) for k in ('device_ms', 'ok', 'error') if k in record})}")
    report.data["wall_s"] = round(time.perf_counter() - start, 1)
    report.write()
    failed = [k for k, r in report.data["configs"].items() if "error" in r or not r.get("ok", True)]
    report.log(f"done in {report.data['wall_s']:.0f} s" + (f"; failed or off: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
