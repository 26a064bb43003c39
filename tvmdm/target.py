"""Targets: user strings ("llvm", "cuda", "cuda -arch=sm_80") -> tvm.target.Target JSON dicts.

TVM 0.27 accepts only dict targets; we fill in the host CPU, core count and the CUDA limits that
MetaSchedule's search space needs.
"""
from __future__ import annotations

import os

import tvm

from tvmdm.errors import TargetError

CUDA_ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90")


def host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu())


def num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_target(target="llvm") -> tvm.target.Target:
    """Accepts a Target, a dict, or "llvm" / "cuda" / "cuda:sm_80"."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if not isinstance(target, str):
        raise TargetError(f"target must be a str, dict or tvm.target.Target, got {type(target).__name__}")
    kind, _, arch = target.partition(":")
    if kind == "llvm":
        if arch:
            raise TargetError(f"unknown target {target!r}: llvm takes no suffix")
        return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "num-cores": num_cores()})
    if kind == "cuda":
        arch = arch or "sm_90"
        if arch not in CUDA_ARCHES:
            raise TargetError(f"unknown CUDA arch {arch!r} in target {target!r}; choose one of {list(CUDA_ARCHES)}")
        return tvm.target.Target(
            {"kind": "cuda", "arch": arch, "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
             "thread_warp_size": 32},
            host={"kind": "llvm", "mcpu": host_cpu()})
    raise TargetError(f"unknown target {target!r}; use 'llvm', 'cuda' or 'cuda:<arch>' ({', '.join(CUDA_ARCHES)})")


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "cuda"
