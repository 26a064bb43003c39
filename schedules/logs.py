"""Tuning logs: which shipped logs suit a target, and the rule that applies their records."""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import tvm
from tvm import relax

import tuning_logs
from schedules.database import TuningLogError, TuningLogWarning, load_database
from schedules.rule import ScheduleRule, is_scheduled
from tvmdm.core.target import vector_bits

SHIPPED_LOGS = tuning_logs.DIRECTORY  # in the source tree, or where a wheel installed them (pruned)
META = "meta.json"


def shipped_logs(target) -> list[str]:
    """The shipped log directories tuned for ``target`` (their meta.json says for which): a target kind
    ("llvm") takes every log of that kind; an llvm Target only those tuned on a CPU whose vector features it
    has (see tuned_wider; the others are named in one warning)."""
    if not os.path.isdir(SHIPPED_LOGS):
        return []
    kind = target if isinstance(target, str) else target.kind.name
    found, skipped = [], []
    for name in sorted(os.listdir(SHIPPED_LOGS)):
        info = meta_or_warn(os.path.join(SHIPPED_LOGS, name))
        if info is None or info.get("target_kind") != kind:
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
                      stacklevel=5)  # the caller of compile / compile_train_step
    return found


_WARNED: set = set()  # sets of skipped logs already named in this process


def tuned_on_this_cpu(logs_dir, target: tvm.target.Target) -> bool:
    """Whether a log's records were tuned on ``target``'s CPU model (meta.json's mcpu, as LLVM names it). Tuned
    register tiles suit the CPU they were measured on: the Zen 4 logs ran the base layer's contractions at
    68-85 % of the GEMM peak on a Sapphire Rapids VM, where schedules.packed reaches 91-97 %. A log without
    meta.json (one a user tuned and passed) is taken to be tuned here."""
    meta = meta_or_warn(logs_dir) if target.kind.name == "llvm" else None
    tuned = _tuned_target(meta, logs_dir)
    return tuned is None or _same_cpu(tuned, target)


def token_rows(shapes) -> int | None:
    """The rows (batch x seq) of a module with these input shapes (a list of dims per input, in order): the
    first input's dims but its last for a [B, S, H] input, all of them for [B, S] token ids; None where
    unknown."""
    dims = next(iter(shapes), None)
    if not dims or not all(isinstance(d, int) for d in dims):
        return None
    return int(np.prod(dims[:-1] if len(dims) >= 3 else dims))


def tuned_for_rows(logs_dir, rows: int | None) -> bool:
    """Whether a log's records were tuned at ``rows`` (meta.json's shapes; None or no meta: taken as yes).
    A contraction record is for its shape alone: BERT-base at (1, 128) with the records of (8, 128) got the
    default schedule for every contraction, 383 ms against onnxruntime's 118 (2 Zen 4 cores)."""
    meta = meta_or_warn(logs_dir)
    tuned = token_rows(list((meta or {}).get("shapes", {}).values()))
    return rows is None or tuned is None or tuned == rows


def _same_cpu(tuned: tvm.target.Target, target: tvm.target.Target) -> bool:
    return str(tuned.attrs.get("mcpu", "")) == str(target.attrs.get("mcpu", "")) and not (
        vector_bits(tuned) > vector_bits(target))


def tuned_wider(meta: dict, target: tvm.target.Target) -> bool:
    """Whether the log was tuned (``meta["target"]``) for wider vector registers than ``target`` has: records
    tuned with AVX-512's 32 registers in mind spill on AVX2 (the same CPU model with AVX-512 masked by its VM:
    56 GFLOP/s against 147 for schedules.packed). Other feature differences (a missing GFNI, say) keep the log."""
    tuned = _tuned_target(meta, "a shipped log") if target.kind.name == "llvm" else None
    return tuned is not None and vector_bits(tuned) > vector_bits(target)


def read_meta(logs_dir) -> dict | None:
    """A log's meta.json (what was tuned, for which target), None where it has none; TuningLogError naming the
    file where it is not a JSON object."""
    path = os.path.join(os.fspath(logs_dir), META)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, OSError) as err:
        raise TuningLogError(f"{path}: unreadable ({err}); fix or delete it (the tuner writes it again)") from None
    if not isinstance(meta, dict):
        raise TuningLogError(f"{path}: expected a JSON object, got {type(meta).__name__}; fix or delete it")
    return meta


def meta_or_warn(logs_dir) -> dict | None:
    """read_meta for compile: a broken meta.json warns and counts as none (the records still apply)."""
    try:
        return read_meta(logs_dir)
    except TuningLogError as err:
        warnings.warn(str(err), TuningLogWarning, stacklevel=2)
        return None


def _tuned_target(meta: dict | None, where) -> "tvm.target.Target | None":
    if not meta or not meta.get("target"):
        return None
    try:
        return tvm.target.Target(json.loads(meta["target"]))
    except (ValueError, TypeError, RuntimeError) as err:
        warnings.warn(f"{where}: meta.json's target is unreadable ({err}); taken as tuned here", TuningLogWarning,
                      stacklevel=3)
        return None


def logs_for_target(dirs: list, target: tvm.target.Target) -> list:
    """The user's log directories whose records can serve ``target``: a log meta.json labels for another
    target kind (CUDA records on a CPU, say) is left out, and one tuned on another CPU model is applied after
    the hand-written schedules; each with a warning that names it."""
    kept = []
    for logs_dir in dirs:
        meta = meta_or_warn(logs_dir) or {}
        kind = meta.get("target_kind")
        if kind and kind != target.kind.name:
            warnings.warn(f"{os.fspath(logs_dir)}: tuned for {kind}, not {target.kind.name}: its records are not "
                          "applied", TuningLogWarning, stacklevel=4)
            continue
        tuned = _tuned_target(meta, logs_dir) if target.kind.name == "llvm" else None
        if tuned is not None and not _same_cpu(tuned, target):
            warnings.warn(f"{os.fspath(logs_dir)}: tuned for {tuned.attrs.get('mcpu', 'another CPU')}, compiling "
                          f"for {target.attrs.get('mcpu', 'this CPU')}: its records apply only where no "
                          "hand-written schedule does", TuningLogWarning, stacklevel=4)
        kept.append(logs_dir)
    return kept


class TuningRecords(ScheduleRule):
    """The best tuned schedule of every kernel the logs (``options.tuning_logs``, the first directory with a
    record wins) have a record for. ``first``: this instance is the one placed before our hand-written
    attention and row schedules, which applies when ``options.records_first`` (the records were tuned on this
    CPU model); the other, after them, applies otherwise. A missing or corrupt log warns (naming the file and
    line) and applies nothing."""

    hand_written = False

    def __init__(self, first: bool):
        self.first = first
        self.name = "tuning records"

    def apply(self, kernels: dict, options) -> dict:
        if options.records_first != self.first or not options.tuning_logs:
            return {}
        mod = tvm.IRModule(kernels)
        for logs_dir in options.tuning_logs:
            database = load_database(os.fspath(logs_dir), best_only=True)
            if database is None:
                continue
            with options.target, database:
                mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        ours = {gv.name_hint: gv for gv in kernels}
        return {ours[gv.name_hint]: f for gv, f in mod.functions.items() if gv.name_hint in ours and is_scheduled(f)}
