"""Tuning logs on disk: a MetaSchedule JSON database (database_workload.json + database_tuning_record.json).

Loading checks every line first: a corrupt or truncated line (a tuner killed mid-write, a bad merge) gives a
warning naming the file and line and is skipped, so compile falls back to default schedules for the kernels
it covered instead of crashing inside TVM; so does a well-formed record TVM cannot read back. A lock file
keeps two tuners from appending to one log at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
import warnings

from schedules.log_lines import RECORDS, WORKLOADS, TuningLogWarning, clean_copy
from tvmdm.core.errors import TvmdmError

LOCK = ".tuning.lock"


class TuningLogError(TvmdmError, ValueError):
    """A tuning log the tuner cannot go on with (its meta.json unreadable, --logs not a directory)."""


class LogsInUseError(TvmdmError, RuntimeError):
    """Another tuner holds the lock on this log directory."""


_LOADED: dict = {}  # (logs dir, size and mtime of its files) -> database: each compile need not re-parse MBs


def _file_stamp(logs_dir: str, best_only: bool = False) -> tuple:
    stamp = [logs_dir, best_only]
    for name in (WORKLOADS, RECORDS):
        path = os.path.join(logs_dir, name)
        st = os.stat(path) if os.path.isfile(path) else None
        stamp.append((st.st_size, st.st_mtime_ns) if st else None)
    return tuple(stamp)


def load_database(logs_dir: str, best_only: bool = False):
    """A read-only MetaSchedule database of the usable records in ``logs_dir``, or None (with a warning).
    Loaded once per process while the files stay unchanged. ``best_only``: the records a compile applies (the
    fastest of each workload: a log of 1,050 records loads in a tenth of the time)."""
    logs_dir = os.fspath(logs_dir)
    if not os.path.isfile(os.path.join(logs_dir, WORKLOADS)):
        warnings.warn(f"{logs_dir}: no tuning log ({WORKLOADS} missing); using default schedules",
                      TuningLogWarning, stacklevel=2)
        return None
    stamp = _file_stamp(logs_dir, best_only)
    if stamp not in _LOADED:
        database = _load(logs_dir, best_only)
        if database is None:
            return None
        _LOADED[stamp] = database
    return _LOADED[stamp]


def _load(logs_dir: str, best_only: bool):
    with tempfile.TemporaryDirectory() as tmp:
        return _readable(logs_dir, tmp, best_only)[0]


def _readable(logs_dir: str, tmp: str, best_only: bool = False):
    """(database, None) when TVM reads the usable lines of ``logs_dir`` (copied into ``tmp``) whole, else
    (database of the records it can read, the lines of ``tmp``'s record file that those are)."""
    from tvm.s_tir import meta_schedule as ms

    rec_numbers = clean_copy(logs_dir, tmp, best_only)
    try:
        # JSONDatabase reads both files into memory when constructed: the temporary copy can go.
        return ms.database.JSONDatabase(work_dir=tmp, allow_missing=False), None
    except Exception:  # noqa: BLE001 - TVM fails the whole log for one record it cannot read back
        return _load_record_by_record(logs_dir, tmp, rec_numbers)


def _load_record_by_record(logs_dir: str, clean_dir: str, rec_numbers: list[int]):
    """The records of ``clean_dir`` TVM can read, one at a time, in a MemoryDatabase, and their lines; a warning
    names each record it cannot (e.g. 0.27 writes rfactor traces of column reductions its own loader then
    rejects: "parallel_for_dynamic error", and JSONDatabase gives up on the whole log)."""
    from tvm.s_tir import meta_schedule as ms

    with open(os.path.join(clean_dir, WORKLOADS)) as f:
        workloads = [json.loads(line) for line in f]
    database, committed, kept = ms.database.MemoryDatabase(), {}, []
    rec_path = os.path.join(logs_dir, RECORDS)
    with open(os.path.join(clean_dir, RECORDS)) as f:
        for number, line in zip(rec_numbers, f):
            index, record = json.loads(line)
            try:
                if index not in committed:
                    committed[index] = database.commit_workload(ms.database.Workload.from_json(workloads[index]).mod)
                database.commit_tuning_record(ms.database.TuningRecord.from_json(record, committed[index]))
                kept.append(line)
            except Exception as err:  # noqa: BLE001 - TVM raises plain errors for semantically bad records
                warnings.warn(f"{rec_path}:{number}: tuning record TVM cannot read back skipped "
                              f"({str(err).strip().splitlines()[-1][:120]})", TuningLogWarning, stacklevel=5)
    return database, kept


def repair(logs_dir: str) -> list[str]:
    """Before a tuner appends to ``logs_dir`` (TVM's JSONDatabase reads it whole and fails on one bad line):
    when any line is unusable (half written by a kill, corrupt, or a record TVM cannot read back), the files
    are set aside whole as ``<file>.<time>.bak`` (nothing is lost) and replaced by their usable lines, the
    same lines compile applies. Returns the backups written (none when the log was clean)."""
    files = [os.path.join(logs_dir, name) for name in (WORKLOADS, RECORDS)]
    if not os.path.isfile(files[0]):
        return []
    with tempfile.TemporaryDirectory() as tmp:
        database, kept = _readable(logs_dir, tmp)
        if kept is not None:
            with open(os.path.join(tmp, RECORDS), "w") as f:
                f.writelines(kept)
        cleaned = [os.path.join(tmp, name) for name in (WORKLOADS, RECORDS)]
        backups = []
        if not all(_same_lines(a, b) for a, b in zip(files, cleaned)):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for original, clean in zip(files, cleaned):
                if os.path.isfile(original):
                    backups.append(f"{original}.{stamp}.bak")
                    os.replace(original, backups[-1])
                shutil.copyfile(clean, original)
    _LOADED[_file_stamp(logs_dir)] = database  # what the log now holds: load_database need not read it again
    return backups


def _same_lines(a: str, b: str) -> bool:
    """Whether two log files hold the same entries (clean_copy re-serializes the lines it keeps)."""
    def entries(path):
        if not os.path.isfile(path):
            return []
        with open(path, encoding="utf-8", errors="replace") as f:
            try:
                return [json.loads(line) for line in f if line.strip()]
            except ValueError:
                return None

    found = entries(a)
    return found is not None and found == entries(b)


@contextlib.contextmanager
def locked(logs_dir: str):
    """Hold an exclusive lock on ``logs_dir`` for a tuning run; a second tuner fails at once, clearly."""
    os.makedirs(logs_dir, exist_ok=True)
    path = os.path.join(logs_dir, LOCK)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise LogsInUseError(f"{logs_dir} is being tuned by another process ({f.read().strip() or 'unknown'}); "
                                 "wait for it or use another --logs directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
