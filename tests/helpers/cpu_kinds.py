"""The CPU kinds the project's sessions and CI land on, as targets any machine can build for.

Each kind is the CPU model LLVM names and the flags its /proc/cpuinfo lists (tests/data/cpuinfo/<kind>, read
off such a VM): building for it takes the same branches (vector width, register tile, bf16 dot product, packed
vs logged contractions) whatever machine the tests run on. Code built for a kind runs here when this machine
has every vector feature the kind's code may use (tvmdm.core.target.features_missing_here); otherwise only its schedules and
generated code are checked.

The whole suite can run as on another kind of the same CPU model: ``TVMDM_CPUINFO=tests/data/cpuinfo/zen4-avx2
make test`` on a Zen 4 with AVX-512 runs what a Zen 4 VM hiding AVX-512 runs.
"""
from __future__ import annotations

import dataclasses
import os
import re

import tvm

from tvmdm.core.target import host_flags, llvm_target, features_missing_here

CPUINFO = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "cpuinfo")


@dataclasses.dataclass(frozen=True)
class CpuKind:
    name: str
    llvm_cpu: str  # what LLVM's host detection calls it
    lanes: int  # fp32 lanes of its vector registers
    bf16_dot: bool  # AVX512-BF16's vdpbf16ps
    amx: bool  # AMX-BF16's tile units (tdpbf16ps)
    int8_dot: bool  # AVX512-VNNI's vpdpbusd
    logs_apply: bool  # the shipped logs (tuned on a Zen 4 with AVX-512) fit its vector width
    packed: bool  # fp32 contractions take schedules.packed at the records' size (no log tuned on this CPU model)

    def target(self) -> tvm.target.Target:
        return tvm.target.Target(llvm_target(self.llvm_cpu, host_flags(os.path.join(CPUINFO, self.name)),
                                             **{"num-cores": 2}))

    def cannot_run_here(self) -> str:
        """Why code built for this kind cannot run on this machine ("" when it can): a skip reason."""
        missing = features_missing_here(self.target())
        return f"this machine lacks {', '.join(missing)}, which code built for {self.name} may use" if missing else ""


KINDS = [
    CpuKind("zen4", "znver4", lanes=16, bf16_dot=True, amx=False, int8_dot=True, logs_apply=True, packed=False),
    # the same Zen 4 with AVX-512 hidden by its VM: LLVM still says znver4
    CpuKind("zen4-avx2", "znver4", lanes=8, bf16_dot=False, amx=False, int8_dot=False, logs_apply=False, packed=True),
    # "Intel Xeon Processor (SapphireRapids)": rocketlake to LLVM (no AVX512-BF16 or AMX in its model)
    CpuKind("sapphirerapids", "rocketlake", lanes=16, bf16_dot=True, amx=True, int8_dot=True, logs_apply=True, packed=True),
]
BY_NAME = {kind.name: kind for kind in KINDS}


def asm_of(compiled) -> str:
    """The generated assembly of a compiled model's kernels."""
    return "".join(m.inspect_source("asm") for m in compiled._executable.mod.imports)


def function_asm(asm: str, name: str) -> list[str]:
    """The lines of function ``name`` (its label up to the next function's) in ``asm``."""
    lines = asm.splitlines()
    start = lines.index(name + ":")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].endswith(":") and
                not lines[i].startswith(("\t", " ", ".L", "#"))), len(lines))
    return lines[start + 1:end]


def stack_spills(lines: list[str], register: str = "zmm") -> list[str]:
    """The stores of ``register`` vectors to the stack among ``lines`` of assembly (AT&T syntax)."""
    return [line for line in lines if re.search(rf"%{register}\d+, -?\d*\(%r[sb]p\)", line)]
