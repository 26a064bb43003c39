"""Targets: user strings ("llvm", "cuda", "cuda -arch=sm_80") -> tvm.target.Target JSON dicts.

TVM 0.27 accepts only dict targets; we fill in the host CPU, core count and the CUDA limits that
MetaSchedule's search space needs.
"""
from __future__ import annotations

import functools
import os

import tvm

from tvmdm.core.errors import TargetError

CUDA_ARCHES = ("sm_80", "sm_86", "sm_89", "sm_90")
# Streaming multiprocessors of the data-center part of each arch (A100, A10, L4, H100/H200): how many blocks a
# kernel's grid needs to keep every one busy (schedules.tensor_cores).
CUDA_MULTIPROCESSORS = {"sm_80": 108, "sm_86": 72, "sm_89": 58, "sm_90": 132}


def host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu())


# Vector-instruction families whose presence /proc/cpuinfo reports under the same name as LLVM (after dropping
# "_", "-" and "."): the ones vectorized kernels may emit.
_CHECKED_FEATURE_PREFIXES = ("avx", "amx", "fma", "f16c", "gfni", "vaes", "vpclmulqdq")


def _normalized(feature: str) -> str:
    return feature.replace("_", "").replace("-", "").replace(".", "").lower()


CPUINFO_ENV = "TVMDM_CPUINFO"  # another file to read the CPU's flags from (host_flags)


def cpuinfo_path() -> str:
    """The file the CPU's model and flags are read from: ``TVMDM_CPUINFO``'s where set, else /proc/cpuinfo."""
    return os.environ.get(CPUINFO_ENV) or "/proc/cpuinfo"


def host_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU flags the kernel reports (normalized names), or None where there is no /proc/cpuinfo.

    ``TVMDM_CPUINFO`` names another file to read them from: code for a machine of the same CPU model with
    fewer features (a VM hiding AVX-512), e.g. the test suite run as on such a machine (tests/cpu_kinds)."""
    cpuinfo = cpuinfo or cpuinfo_path()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return {_normalized(flag) for flag in line.partition(":")[2].split()}
    except OSError:
        return None
    return None


def missing_host_features(cpu: str, flags: set[str] | None) -> list[str]:
    """LLVM features of ``cpu`` that the host does not have.

    LLVM names the host CPU by its family and model alone: a Zen 4 VM whose hypervisor hides AVX-512 is still
    "znver4", and code built for it dies with SIGILL. Each feature LLVM assumes for ``cpu`` in the vector
    families above but the kernel's flags lack is returned, to be switched off with ``mattr``."""
    if flags is None:
        return []
    assumed = sorted(_cpu_features(cpu))
    return [f for f in assumed if _normalized(f).startswith(_CHECKED_FEATURE_PREFIXES) and _normalized(f) not in flags]


@functools.lru_cache(maxsize=None)
def _cpu_features(cpu: str) -> frozenset[str]:
    return frozenset(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(
        tvm.target.Target({"kind": "llvm", "mcpu": cpu})))


@functools.lru_cache(maxsize=1)
def _known_vector_features() -> frozenset[str]:
    """Every feature in the vector families above that LLVM knows for some x86 CPU (its own spelling)."""
    cpus = tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm", "mcpu": "x86-64"}))
    known = set()
    for cpu in cpus:
        try:
            known |= _cpu_features(str(cpu))
        except Exception:  # noqa: BLE001 - a name LLVM lists but will not build a target for
            continue
    return frozenset(f for f in known if _normalized(f).startswith(_CHECKED_FEATURE_PREFIXES))


def extra_host_features(cpu: str, flags: set[str] | None) -> list[str]:
    """Features the host has that LLVM does not assume for ``cpu``.

    A VM may present a CPU model older than the silicon: a Sapphire Rapids VM here is "Intel Xeon Processor",
    which LLVM calls "rocketlake", a model without AVX512-BF16 or AMX, although /proc/cpuinfo lists both.
    Each such feature is switched on with ``mattr`` (bf16 contractions need it)."""
    if flags is None:
        return []
    assumed = _cpu_features(cpu)
    return sorted(f for f in _known_vector_features() if f not in assumed and _normalized(f) in flags)


def llvm_target(cpu: str, flags: set[str] | None, **extra) -> dict:
    """The llvm target dict for a CPU LLVM calls ``cpu`` whose kernel reports ``flags`` (host_flags' form): the
    model's vector features the flags lack switched off, the ones they list but the model lacks switched on.
    Tests build the other CPU kinds' targets with it (tests/cpu_kinds.py)."""
    target = {"kind": "llvm", "mcpu": cpu, **extra}
    mattr = [f"-{f}" for f in missing_host_features(cpu, flags)] + [f"+{f}" for f in extra_host_features(cpu, flags)]
    if mattr:
        target["mattr"] = mattr
    return target


def host_llvm_target(**extra) -> dict:
    """The llvm target dict for this machine (llvm_target of its CPU and /proc/cpuinfo's flags)."""
    return llvm_target(host_cpu(), host_flags(), **extra)


def vector_features(target: tvm.target.Target) -> set[str]:
    """The vector-family features (host_flags' spelling) code built for an llvm ``target`` may use."""
    has = tvm.target.codegen.target_has_features
    return {_normalized(f) for f in _known_vector_features() if has(f, target)}


def features_missing_here(target: tvm.target.Target) -> list[str]:
    """The vector features code built for ``target`` may use that this machine lacks ([]: it runs here)."""
    flags = host_flags()
    return [] if flags is None else sorted(vector_features(target) - flags)


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
        return tvm.target.Target(host_llvm_target(**{"num-cores": num_cores()}))
    if kind == "cuda":
        arch = arch or "sm_90"
        if arch not in CUDA_ARCHES:
            raise TargetError(f"unknown CUDA arch {arch!r} in target {target!r}; choose one of {list(CUDA_ARCHES)}")
        return tvm.target.Target(
            {"kind": "cuda", "arch": arch, "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
             "thread_warp_size": 32},
            host=host_llvm_target())
    raise TargetError(f"unknown target {target!r}; use 'llvm', 'cuda' or 'cuda:<arch>' ({', '.join(CUDA_ARCHES)})")


def cuda_multiprocessors(target: tvm.target.Target) -> int:
    return CUDA_MULTIPROCESSORS.get(str(target.attrs.get("arch", "")), CUDA_MULTIPROCESSORS["sm_90"])


def vector_bits(target: tvm.target.Target) -> int:
    """The vector register width an llvm target's code may use: 512 (AVX-512), 256 (AVX) or 128."""
    has = tvm.target.codegen.target_has_features
    return 512 if has("avx512f", target) else 256 if has("avx", target) else 128


def vector_lanes(target: tvm.target.Target) -> int:
    """fp32 values per vector register of an llvm target: 16 with AVX-512, 8 with AVX2."""
    return vector_bits(target) // 32


def cpu_has(target: tvm.target.Target, feature: str) -> bool:
    """Whether an llvm ``target``'s CPU (its mcpu and mattr, as LLVM knows them) has ``feature`` (LLVM's name:
    "avx512vnni", "avx512bf16", "amx-bf16", ...); False for other target kinds."""
    return target.kind.name == "llvm" and bool(tvm.target.codegen.target_has_features(feature, target))


def has_int8_dot(target: tvm.target.Target) -> bool:
    """Whether ``target``'s CPU has AVX512-VNNI's vpdpbusd."""
    return cpu_has(target, "avx512vnni")


def has_amx_bf16(target: tvm.target.Target) -> bool:
    """Whether ``target``'s CPU (its mcpu and mattr, as LLVM knows them) has the AMX-BF16 tile units."""
    return cpu_has(target, "amx-bf16")


def has_amx_int8(target: tvm.target.Target) -> bool:
    """Whether ``target``'s CPU (its mcpu and mattr, as LLVM knows them) has the AMX-INT8 tile units."""
    return cpu_has(target, "amx-int8")


def has_avx_vnni(target: tvm.target.Target) -> bool:
    """Whether ``target``'s CPU has AVX-VNNI's vpdpbusd on 256-bit registers but not AVX512-VNNI's (Alder Lake
    and the client parts after it, which have no AVX-512)."""
    return cpu_has(target, "avxvnni") and not has_int8_dot(target)


def attention_on_matrix_units(target: tvm.target.Target, precision: str) -> bool:
    """Whether the attention's contractions run on matrix units: CUDA (tensor cores; schedules.tensor_cores) or
    bf16 on a CPU with AMX-BF16 (schedules.amx). There the paper level keeps them as batched matmuls, one
    contraction a kernel, rather than einsums fused with the softmax (tvmdm.transform.graph_rewrites); CPU
    inference runs them as one tile kernel instead (tvmdm.build.options, tvmdm.transform.tile_attention)."""
    return is_gpu(target) or (precision == "bf16" and has_amx_bf16(target))


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name == "cuda"
