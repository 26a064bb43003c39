"""The lines of a MetaSchedule JSON database, read tolerantly and pruned: standard library only, so the wheel's
build (which has no TVM) prunes the shipped logs with the code compile reads them with.

A log directory holds ``database_workload.json`` (one [hash, module] line per kernel) and
``database_tuning_record.json`` (one [workload index, record] line per measured schedule).
"""
from __future__ import annotations

import json
import os
import warnings

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"


class TuningLogWarning(UserWarning):
    """A tuning log line (or the whole log) could not be used; compile continues without it."""


def _read_lines(path: str, check) -> list[tuple[int, str | None]]:
    """(line number, line or None when unusable) for each non-empty line; warns for each unusable one."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                check(json.loads(line))
                out.append((number, line if line.endswith("\n") else line + "\n"))
            except (ValueError, TypeError, IndexError, KeyError) as err:
                warnings.warn(f"{path}:{number}: corrupt tuning log line skipped ({type(err).__name__}: "
                              f"{str(err)[:80]})", TuningLogWarning, stacklevel=3)
                out.append((number, None))
    return out


def _check_workload(entry) -> None:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str)):
        raise ValueError("expected [hash, module]")


def _check_record(entry) -> None:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int) and isinstance(entry[1], list)):
        raise ValueError("expected [workload index, record]")


def _mean_seconds(record: list) -> float:
    """A record's measured mean run time (TuningRecord JSON: [trace, run_secs, target, args]); inf unmeasured."""
    secs = record[1] if len(record) > 1 and isinstance(record[1], list) else []
    secs = [float(x) for x in secs if isinstance(x, (int, float))]
    return sum(secs) / len(secs) if secs and max(secs) < 1e9 else float("inf")  # 1e10: a failed build or run


def clean_copy(logs_dir: str, out_dir: str, best_only: bool = False) -> list[int]:
    """Copy the usable lines of ``logs_dir``'s database into ``out_dir``, renumbering workload references
    around dropped workload lines. Returns the line number in ``logs_dir`` of each record kept.

    ``best_only``: what a compile applies, no more: the fastest measured record of each workload and the
    workloads that have one (a tuner keeps every record: its cost model learns from them)."""
    wl_lines = _read_lines(os.path.join(logs_dir, WORKLOADS), _check_workload)
    records = []  # (line number, workload index in wl_lines, record)
    rec_path = os.path.join(logs_dir, RECORDS)
    if os.path.exists(rec_path):
        for number, line in _read_lines(rec_path, _check_record):
            if line is None:
                continue
            entry = json.loads(line)
            if not (0 <= entry[0] < len(wl_lines)) or wl_lines[entry[0]][1] is None:
                warnings.warn(f"{rec_path}:{number}: record refers to workload {entry[0]}, which is missing or "
                              "corrupt; skipped", TuningLogWarning, stacklevel=2)
                continue
            records.append((number, entry[0], entry[1]))
    if best_only:
        best = {}
        for item in records:
            secs = _mean_seconds(item[2])
            if secs < float("inf") and (item[1] not in best or secs < _mean_seconds(best[item[1]][2])):
                best[item[1]] = item
        records = sorted(best.values())
    used = {index for _, index, _ in records}
    new_index, kept_wl = {}, []
    for old, (_, line) in enumerate(wl_lines):
        if line is not None and (old in used or not best_only):
            new_index[old] = len(kept_wl)
            kept_wl.append(line)
    kept_rec = [json.dumps([new_index[index], record]) + "\n" for _, index, record in records]
    rec_numbers = [number for number, _, _ in records]
    with open(os.path.join(out_dir, WORKLOADS), "w") as f:
        f.writelines(kept_wl)
    with open(os.path.join(out_dir, RECORDS), "w") as f:
        f.writelines(kept_rec)
    return rec_numbers


def prune_directory(logs_dir: str, out_dir: str) -> tuple[int, int]:
    """Write into ``out_dir`` what a compile applies from ``logs_dir`` (the fastest record of each workload;
    meta.json as is). Returns (records read, records kept)."""
    os.makedirs(out_dir, exist_ok=True)
    kept = clean_copy(logs_dir, out_dir, best_only=True)
    meta = os.path.join(logs_dir, "meta.json")
    if os.path.isfile(meta):
        with open(meta, "rb") as src, open(os.path.join(out_dir, "meta.json"), "wb") as dst:
            dst.write(src.read())
    with open(os.path.join(logs_dir, RECORDS)) as f:
        total = sum(1 for line in f if line.strip())
    return total, len(kept)
