"""Compile here, run there: build everything a lent GPU will run, sized to travel in one device call.

    python -m tvmdm.bench.gpu_prepare [--out .device/run] [--arch sm_90] [--only NAME ...]

Writes into OUT (ignored by git; name it in the device call's ``carry``):
  runtime.tar.xz    TVM's runtime alone (libtvm_runtime + its CUDA part, TVM's Python files, tvm-ffi for the GPU
                    machine's Python 3.12), no compiler: a few MiB instead of the wheel's ~100;
  NAME.so           each configuration of ``tvmdm.bench.gpu_plan`` compiled for ``--arch`` (CUDA code inside);
  NAME.json         what the GPU machine needs to run it: the runner's manifest, the weights' recipe (model name,
                    order, sha256) and the compile's own numbers;
  plan.json         the plan, its expected GPU seconds (torch.compile included) and the repository's size.
It refuses (exit 2) when OUT would not fit one call beside the repository's files. Then
``bash scripts/device/run_gpu.sh`` on the GPU machine runs it (``tvmdm.bench.gpu_run``).
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import subprocess
import sys
import tarfile
import time
import zipfile

from tvmdm.bench import gpu_plan
from tvmdm.bench.gpu_plan import CARRY_LIMIT, TREE_MARGIN, GpuConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPU_PYTHON = "3.12"  # the lent GPU machine's Python (tvm-ffi's extension is built per Python version)
# What of TVM's package a process that only loads and runs compiled modules leaves untouched: the compiler
# library (~260 MB), the C++ sources and headers bundled for JIT builds.
RUNTIME_SKIP = ("lib/libtvm_compiler.so", "3rdparty/", "src/", "include/")


def runtime_members(tvm_dir: str):
    """(path in the archive, file on disk) for TVM's runtime-only package: Python files and runtime libraries."""
    for folder, _, files in os.walk(tvm_dir):
        for name in files:
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, tvm_dir).replace(os.sep, "/")
            if "__pycache__" in rel or rel.startswith(RUNTIME_SKIP):
                continue
            yield f"tvm/{rel}", full


def tvm_ffi_wheel(cache: str, python: str = GPU_PYTHON) -> str:
    """tvm-ffi's wheel for the GPU machine's Python, at the version pinned in pyproject.toml (downloaded once)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        pin = next(d for d in tomllib.load(f)["project"]["dependencies"] if d.startswith("apache-tvm-ffi=="))
    version = pin.split("==", 1)[1].split(";")[0].strip()
    found = glob.glob(os.path.join(cache, f"apache_tvm_ffi-{version}-cp{python.replace('.', '')}-*.whl"))
    if not found:
        platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                     for a in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", python, "--implementation", "cp", *platforms, "-d", cache,
                        f"apache-tvm-ffi=={version}"], check=True)
        found = glob.glob(os.path.join(cache, f"apache_tvm_ffi-{version}-cp{python.replace('.', '')}-*.whl"))
    return found[0]


def write_runtime(path: str, ffi_wheel: str | None) -> int:
    """runtime.tar.xz: site/tvm (runtime-only) and site/tvm_ffi (from ``ffi_wheel``; none: left out, for tests
    that only size it). Returns its size in bytes."""
    import tvm

    tvm_dir = os.path.dirname(tvm.__file__)
    with tarfile.open(path, "w:xz", preset=6) as tar:
        for arc, full in runtime_members(tvm_dir):
            tar.add(full, f"site/{arc}")
        if ffi_wheel:
            with zipfile.ZipFile(ffi_wheel) as wheel:
                for info in wheel.infolist():
                    if info.is_dir() or ".dist-info/" in info.filename:
                        continue
                    data = wheel.read(info)
                    member = tarfile.TarInfo(f"site/{info.filename}")
                    member.size, member.mode = len(data), 0o755 if info.filename.endswith(".so") else 0o644
                    tar.addfile(member, io.BytesIO(data))
    return os.path.getsize(path)


def compile_config(config: GpuConfig, proto, target: str):
    """(runner, its manifest, the weights' names in order) of ``config`` (its model ``proto``) compiled for
    ``target``."""
    import tvmdm
    from tvmdm.build.shapes import resolve_shapes
    from tvmdm.core.training import BENCH_LR

    if config.train:
        step = tvmdm.compile_train_step(proto, loss="mse", optimizer=tvmdm.AdamW(lr=BENCH_LR), target=target,
                                        batch=config.batch, seq=config.seq, precision=config.precision)
        return step, step.manifest(), list(step.weight_names)
    from tvmdm.runtime.artifact import runner_manifest

    compiled = tvmdm.compile(proto, target=target, precision=config.precision,
                             shapes=resolve_shapes(config.model, None, config.batch, config.seq))
    return compiled, runner_manifest(compiled), list(compiled.params())


def initializers(proto) -> dict:
    """A model's initializers by name: for an embedded model, what both machines rebuild from its config and
    seed."""
    import onnx

    return {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}


def prepare_config(config: GpuConfig, target: str, out: str, log=print) -> dict:
    from tvmdm import models

    proto = models.default_model(config.model)  # (BERT-base: 4 s to draw its weights: once per configuration)
    t0 = time.perf_counter()
    runner, manifest, names = compile_config(config, proto, target)
    compile_s = time.perf_counter() - t0
    weights = initializers(proto)
    missing = [n for n in names if n not in weights]
    if missing:
        raise RuntimeError(f"{config.name}: weights {missing[:3]} are not initializers of {config.model}")
    lib = os.path.join(out, f"{config.name}.so")
    runner._executable.export_library(lib)
    entry = {"config": config.to_json(), "manifest": manifest, "library": os.path.basename(lib),
             "weights": {"model": config.model, "names": names,
                         "sha256": gpu_plan.weights_digest({n: weights[n] for n in names})},
             "compile_s": round(compile_s, 1), "kernels": len(getattr(runner, "kernels", []) or []),
             "target": target}
    with open(os.path.join(out, f"{config.name}.json"), "w") as f:
        json.dump(entry, f, indent=1)
    log(f"{config.name}: compiled in {compile_s:.1f} s, {os.path.getsize(lib) / 2**20:.2f} MiB")
    return entry


def tree_bytes() -> int:
    """Bytes of the repository's tracked files: they travel with every device call."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum(os.path.getsize(os.path.join(ROOT, f.decode())) for f in files
               if f and os.path.isfile(os.path.join(ROOT, f.decode())))


def folder_bytes(folder: str) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def check_sizes(out: str, tree: int) -> None:
    """The run folder must travel in one call beside the tree; SystemExit naming the biggest files otherwise."""
    sizes = folder_bytes(out)
    total = sum(sizes.values())
    if total > CARRY_LIMIT - TREE_MARGIN or total + tree > CARRY_LIMIT:
        biggest = ", ".join(f"{n} {s / 2**20:.1f} MiB" for n, s in sorted(sizes.items(), key=lambda x: -x[1])[:3])
        raise SystemExit(f"{out} holds {total / 2**20:.1f} MiB, the repository {tree / 2**20:.1f} MiB: over the "
                         f"{CARRY_LIMIT // 2**20} MiB one device call carries (biggest: {biggest}); run fewer "
                         "configurations (--only)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvmdm.bench.gpu_prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, ".device", "run"))
    parser.add_argument("--arch", default=gpu_plan.DEFAULT_ARCH)
    parser.add_argument("--target", help="default cuda:ARCH; llvm builds the tiny plan's path for a CPU (tests)")
    parser.add_argument("--plan", choices=sorted(gpu_plan.PLANS), default="default")
    parser.add_argument("--only", nargs="*", help="configuration names of the plan to build (default: all)")
    parser.add_argument("--ffi-wheel", help="tvm-ffi wheel for the GPU machine's Python (default: pip download); "
                        "'none': leave tvm-ffi out (a run on this machine uses its own)")
    args = parser.parse_args(argv)
    target = args.target or f"cuda:{args.arch}"
    full = gpu_plan.PLANS[args.plan]
    plan = [c for c in full if not args.only or c.name in args.only]
    unknown = set(args.only or ()) - {c.name for c in full}
    if unknown:
        parser.error(f"no configuration {sorted(unknown)} in the plan: {[c.name for c in full]}")
    os.makedirs(args.out, exist_ok=True)
    for stale in glob.glob(os.path.join(args.out, "*")):
        os.remove(stale)
    if args.ffi_wheel == "none":
        ffi = None
    else:
        cache = os.path.join(ROOT, ".device", "cache")
        os.makedirs(cache, exist_ok=True)
        ffi = args.ffi_wheel or tvm_ffi_wheel(cache)
    print(f"runtime.tar.xz: {write_runtime(os.path.join(args.out, 'runtime.tar.xz'), ffi) / 2**20:.1f} MiB")
    for config in {c.name: c for c in [gpu_plan.PREFLIGHT, *plan]}.values():  # the preflight's twin: once
        prepare_config(config, target, args.out)
    tree = tree_bytes()
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump({"arch": args.arch, "target": target, "preflight": gpu_plan.PREFLIGHT.name,
                   "plan": [c.to_json() for c in plan], "expected_gpu_s": gpu_plan.plan_cost(plan, torch_compile=True), "tree_bytes": tree,
                   "created": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    check_sizes(args.out, tree)
    total = sum(folder_bytes(args.out).values())
    print(f"{args.out}: {total / 2**20:.1f} MiB + repository {tree / 2**20:.1f} MiB (one call carries "
          f"{CARRY_LIMIT // 2**20}); expected GPU time {gpu_plan.plan_cost(plan, True):.0f} s with torch.compile")
    carry = os.path.relpath(args.out, ROOT)
    print(f"next, one device call: run(command='bash scripts/device/run_gpu.sh', carry=['{carry}'], timeout_s=600)"
          + (f" with TVMDM_RUN_DIR={carry}" if carry != os.path.join(".device", "run") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
