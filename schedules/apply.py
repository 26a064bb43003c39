"""Apply shipped or user tuning logs to a fused module; report which kernels they covered."""
from __future__ import annotations

import os

import tvm
from tvm import relax, tirx

from schedules.database import load_database

SHIPPED_LOGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning_logs")
META = "meta.json"


def shipped_logs(target_kind: str) -> list[str]:
    """The shipped log directories tuned for ``target_kind`` (their meta.json says which)."""
    import json

    if not os.path.isdir(SHIPPED_LOGS):
        return []
    found = []
    for name in sorted(os.listdir(SHIPPED_LOGS)):
        meta = os.path.join(SHIPPED_LOGS, name, META)
        if os.path.isfile(meta):
            with open(meta) as f:
                if json.load(f).get("target_kind") == target_kind:
                    found.append(os.path.join(SHIPPED_LOGS, name))
    return found


def is_scheduled(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))


def apply_hand_schedule(mod: tvm.IRModule, schedule) -> tuple[tvm.IRModule, list[str]]:
    """``schedule(func) -> scheduled func or None`` (not its kind) on every unscheduled kernel of ``mod``;
    returns the module and the kernels it took. A kernel the rule fails on is left to the default schedule."""
    done = []
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
            continue
        try:
            scheduled = schedule(func.with_attr("global_symbol", gv.name_hint))
        except Exception:  # noqa: BLE001 - a loop nest the rule does not fit
            scheduled = None
        if scheduled is not None:
            mod[gv] = scheduled
            done.append(gv.name_hint)
    return mod, done


def kernels(mod: tvm.IRModule) -> list[str]:
    return sorted(gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc))


def apply_tuning_logs(mod: tvm.IRModule, target: tvm.target.Target, logs) -> tuple[tvm.IRModule, list[str]]:
    """Replace every kernel the log has a record for by its best tuned schedule.

    Returns the module and the names of the kernels that got a tuned schedule. A missing or corrupt log
    warns (naming the file and line) and applies nothing. ``logs`` is a directory or a list of them (the first
    that has a record for a kernel wins)."""
    dirs = [logs] if isinstance(logs, (str, os.PathLike)) else list(logs)
    before = {name for name in kernels(mod) if is_scheduled(mod[name])}
    for logs_dir in dirs:
        database = load_database(os.fspath(logs_dir))
        if database is None:
            continue
        with target, database:
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
    applied = [name for name in kernels(mod) if is_scheduled(mod[name]) and name not in before]
    return mod, applied
