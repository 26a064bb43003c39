"""``tvmdm bench --no-amx``: a CPU with AMX benchmarked as one without it.

What it is for: measuring, on a Sapphire Rapids host, the paths a CPU without AMX runs (Zen 4's int8 on
AVX512-VNNI, bf16 on AVX512-BF16), every system on the same footing. onnxruntime (MLAS) and PyTorch (oneDNN)
put int8 and bf16 contractions on the AMX tile units once Linux grants their process the tile data state, and
neither has a switch to turn that off. So each benchmark process is refused that one request: a seccomp filter
fails ``arch_prctl(ARCH_REQ_XCOMP_PERM)`` with EPERM, and both libraries take their AVX-512 kernels, as on a
CPU without AMX. tvmdm reads the CPU's flags without the AMX ones (``TVMDM_CPUINFO``, a copy of /proc/cpuinfo
without them), so it builds no tile kernel. The microarchitecture stays the host's: a proxy for another CPU's
ratios, not its timings.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import tempfile

from tvmdm.core.errors import TvmdmError
from tvmdm.core.target import CPUINFO_ENV, cpuinfo_path
from tvmdm.runtime.amx import ARCH_REQ_XCOMP_PERM, SYS_ARCH_PRCTL, refuse_off_x86_64_linux

DENY_ENV = "TVMDM_BENCH_NO_AMX"  # set for the benchmark processes: each installs the filter first

_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_EPERM = 1
# classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
_LOAD_WORD, _JUMP_IF_EQUAL, _RETURN = 0x20, 0x15, 0x06
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16
_ALLOW, _FAIL_EPERM = 0x7FFF0000, 0x00050000 | _EPERM


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


def _filter() -> list[_Instruction]:
    """arch_prctl(ARCH_REQ_XCOMP_PERM, ...) fails with EPERM; every other call (and other ABIs) goes through.
    Jumps count the instructions they skip."""
    return [_Instruction(_LOAD_WORD, 0, 0, _OFFSET_ARCH),
            _Instruction(_JUMP_IF_EQUAL, 0, 5, _AUDIT_ARCH_X86_64),
            _Instruction(_LOAD_WORD, 0, 0, _OFFSET_NR),
            _Instruction(_JUMP_IF_EQUAL, 0, 3, SYS_ARCH_PRCTL),
            _Instruction(_LOAD_WORD, 0, 0, _OFFSET_ARG0),  # the low half of the first argument
            _Instruction(_JUMP_IF_EQUAL, 0, 1, ARCH_REQ_XCOMP_PERM),
            _Instruction(_RETURN, 0, 0, _FAIL_EPERM),
            _Instruction(_RETURN, 0, 0, _ALLOW)]


def deny_tile_state() -> None:
    """Refuse this process and every process it starts the AMX tile state, for good (a seccomp filter cannot
    be taken back: call it only in a process of its own)."""
    refuse_off_x86_64_linux("--no-amx works")
    instructions = _filter()
    program = _Program(len(instructions), (_Instruction * len(instructions))(*instructions))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        code = ctypes.get_errno()
        raise TvmdmError(f"--no-amx: Linux would not install the seccomp filter that refuses the AMX tile state "
                         f"({os.strerror(code)})")


def deny_tile_state_if_asked() -> bool:
    """The first thing a benchmark process does (tvmdm.bench.isolated): deny itself the tile state under
    --no-amx. Whether it did."""
    if os.environ.get(DENY_ENV) != "1":
        return False
    deny_tile_state()
    return True


def flags_without_amx(cpuinfo: str) -> str:
    """/proc/cpuinfo's text with the AMX flags (amx_tile, amx_bf16, amx_int8, ...) left out of its flags lines."""
    def strip(match):
        return match.group(1) + " ".join(f for f in match.group(2).split() if not f.startswith("amx"))
    return re.sub(r"^(flags\s*:\s*)(.*)$", strip, cpuinfo, flags=re.MULTILINE)


@contextlib.contextmanager
def without_amx():
    """Within: tvmdm builds for this CPU without AMX, and the benchmark processes started from here are refused
    the tile state. This process itself keeps it (its onnxruntime reference runs are exact either way)."""
    source = cpuinfo_path()  # a CPU kind's flags the user already chose
    try:
        with open(source) as f:
            cpuinfo = f.read()
    except OSError as err:
        raise TvmdmError(f"--no-amx needs the CPU's flags from {source} ({err})") from None
    saved = {name: os.environ.get(name) for name in (DENY_ENV, CPUINFO_ENV)}
    with tempfile.TemporaryDirectory(prefix="tvmdm-no-amx-") as tmp:
        path = os.path.join(tmp, "cpuinfo")
        with open(path, "w") as f:
            f.write(flags_without_amx(cpuinfo))
        os.environ.update({DENY_ENV: "1", CPUINFO_ENV: path})
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
