"""The tile state a process must hold before it runs AMX instructions (Linux).

Linux gives a process AMX's 8 KiB tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM with
XFEATURE_XTILEDATA); without it, the first tile instruction kills the process with SIGILL. TVM 0.27's runtime
does not ask, so a module whose kernels use the tile units asks here, once per process, before its first call.
A module built for AMX on a CPU without it is refused with an error rather than a SIGILL.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform

from tvmdm.core.errors import TvmdmError

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
AMX_FLAGS = ("amxtile", "amxbf16")  # /proc/cpuinfo's amx_tile, amx_bf16, normalized as tvmdm.core.target does


def host_has_amx(flags: set[str] | None = None) -> bool:
    from tvmdm.core.target import host_flags

    flags = host_flags() if flags is None else flags
    return bool(flags) and all(f in flags for f in AMX_FLAGS)


def refuse_off_x86_64_linux(what: str) -> None:
    """TvmdmError "``what`` works on x86-64 Linux only" elsewhere (the tile state is asked of Linux by arch_prctl)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise TvmdmError(f"{what} on x86-64 Linux only, not {platform.system()} {platform.machine()}")


@functools.lru_cache(maxsize=1)
def request_tile_state() -> None:
    """Ask Linux, once per process, for the tile data state; TvmdmError (with the reason) where it refuses."""
    refuse_off_x86_64_linux("AMX kernels run")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        code = ctypes.get_errno()
        raise TvmdmError(f"Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: "
                         f"{errno.errorcode.get(code, code)} {os.strerror(code)}); the kernel may be older than "
                         "5.16: compile without AMX (precision='fp32', or a target without amx-bf16)")


def prepare(uses_amx: bool) -> None:
    """Before a module's first call: its kernels may use the tile units only where this CPU has them, and
    then only once Linux has granted the tile state."""
    if not uses_amx:
        return
    if not host_has_amx():
        raise TvmdmError("this module runs its contractions on AMX tiles (built for a CPU with AMX-BF16), but this "
                         "CPU has no AMX: compile it again on this machine (its bf16 then runs on AVX512-BF16 "
                         "or fp32)")
    request_tile_state()
