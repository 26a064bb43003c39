"""Apply shipped or user tuning logs to a fused module; report which kernels they covered."""
from __future__ import annotations

import json
import logging
import os
import warnings

import tvm
from tvm import relax, tirx
from tvm.s_tir import schedule as sch_mod

from schedules.database import TuningLogWarning, load_database
from tvmdm.target import vector_bits

SHIPPED_LOGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning_logs")
META = "meta.json"
log = logging.getLogger("tvmdm")


def shipped_logs(target) -> list[str]:
    """The shipped log directories tuned for ``target`` (their meta.json says for which): a target kind
    ("llvm") takes every log of that kind; an llvm Target only those tuned on a CPU whose vector features it
    has (see tuned_wider; the others are named in one warning)."""
    if not os.path.isdir(SHIPPED_LOGS):
        return []
    kind = target if isinstance(target, str) else target.kind.name
    found, skipped = [], []
    for name in sorted(os.listdir(SHIPPED_LOGS)):
        meta = os.path.join(SHIPPED_LOGS, name, META)
        if not os.path.isfile(meta):
            continue
        with open(meta) as f:
            info = json.load(f)
        if info.get("target_kind") != kind:
            continue
        if not isinstance(target, str) and tuned_wider(info, target):
            skipped.append(name)
        else:
            found.append(os.path.join(SHIPPED_LOGS, name))
    if skipped and tuple(skipped) not in _WARNED:
        _WARNED.add(tuple(skipped))
        warnings.warn(f"shipped tuning logs {', '.join(skipped)} were tuned for wider vector registers than this "
                      f"CPU's ({vector_bits(target)}-bit): not applied (their schedules run 2-3x slower here than "
                      "tvmdm's own packed contractions; `tvmdm tune` tunes for this CPU)", TuningLogWarning,
                      stacklevel=4)  # the caller of compile / compile_train_step
    return found


_WARNED: set = set()  # sets of skipped logs already named in this process


def tuned_on_this_cpu(logs_dir, target: tvm.target.Target) -> bool:
    """Whether a log's records were tuned on ``target``'s CPU model (meta.json's mcpu, as LLVM names it). Tuned
    register tiles suit the CPU they were measured on: the Zen 4 logs ran the base layer's contractions at
    68-85 % of the GEMM peak on a Sapphire Rapids VM, where schedules.packed reaches 91-97 %. A log without
    meta.json (one a user tuned and passed) is taken to be tuned here."""
    meta_path = os.path.join(os.fspath(logs_dir), META)
    if target.kind.name != "llvm" or not os.path.isfile(meta_path):
        return True
    with open(meta_path) as f:
        tuned = json.load(f).get("target")
    if not tuned:
        return True
    tuned = tvm.target.Target(json.loads(tuned))
    return str(tuned.attrs.get("mcpu", "")) == str(target.attrs.get("mcpu", "")) and not (
        vector_bits(tuned) > vector_bits(target))


def tuned_wider(meta: dict, target: tvm.target.Target) -> bool:
    """Whether the log was tuned (``meta["target"]``) for wider vector registers than ``target`` has: records
    tuned with AVX-512's 32 registers in mind spill on AVX2 (the same CPU model with AVX-512 masked by its VM:
    56 GFLOP/s against 147 for schedules.packed). Other feature differences (a missing GFNI, say) keep the log."""
    if target.kind.name != "llvm" or "target" not in meta:
        return False
    return vector_bits(tvm.target.Target(json.loads(meta["target"]))) > vector_bits(target)


def is_scheduled(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))


def finds_block(func: tirx.PrimFunc, finder) -> bool:
    """Whether a hand-schedule rule's ``finder(schedule) -> block or None`` takes ``func`` (tuning leaves such
    kernels out)."""
    try:
        return finder(sch_mod.Schedule(func)) is not None
    except Exception:  # noqa: BLE001 - no block tree (hand-written kernels) or a form the rule does not read
        return False


def apply_hand_schedule(mod: tvm.IRModule, schedule) -> tuple[tvm.IRModule, list[str]]:
    """``schedule(func) -> scheduled func or None`` (not its kind) on every unscheduled kernel of ``mod``;
    returns the module and the kernels it took. A kernel the rule fails on is left to the default schedule."""
    done = []
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
            continue
        try:
            scheduled = schedule(func.with_attr("global_symbol", gv.name_hint))
        except Exception as err:  # noqa: BLE001 - a loop nest the rule does not fit
            log.debug("%s: hand schedule %s failed, left to the next rule: %s", gv.name_hint,
                      getattr(schedule, "__name__", schedule), str(err).splitlines()[0] if str(err) else type(err).__name__)
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
