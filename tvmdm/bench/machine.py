"""What a benchmark ran on: CPU model and the flags that matter for these kernels, threads, GPU, library versions."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess

from tvmdm.core.target import cpuinfo_path

# Instruction-set flags that decide which kernels a CPU can run fast (fp32 FMA, AVX-512, bf16/int8 dot products).
INTERESTING_FLAGS = ("fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
                     "amx_bf16", "amx_int8")
PACKAGES = ("apache-tvm", "apache-tvm-ffi", "onnx", "onnxruntime", "onnxruntime-gpu", "numpy", "torch",
            "transformers", "xgboost", "xgboost-cpu")


def cpu_info() -> dict:
    """The CPU's model and flags, as tvmdm built for it (TVMDM_CPUINFO's file where set: another CPU kind's flags,
    or --no-amx's copy of this CPU's without AMX)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo_path()) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "flags": [f for f in INTERESTING_FLAGS if f in flags], "logical_cpus": os.cpu_count()}


def gpu_info() -> list[str]:
    """Names of NVIDIA GPUs nvidia-smi sees (empty when there is none)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    found["python"] = platform.python_version()
    return found


def machine_info(threads: int) -> dict:
    return {"cpu": cpu_info(), "threads": threads, "gpus": gpu_info(), "os": platform.platform(),
            "versions": versions()}
