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

from tvmdm.core.errors import TvmdmError

WORKLOADS = "database_workload.json"
RECORDS = "database_tuning_record.json"
LOCK = ".tuning.lock"


class TuningLogWarning(UserWarning):
    """A tuning log line (or the whole log) could not be used; compile continues without it."""


class TuningLogError(TvmdmError, ValueError):
    """A tuning log the tuner cannot go on with (its meta.json unreadable, --logs not a directory)."""


class LogsInUseError(TvmdmError, RuntimeError):
    """Another tuner holds the lock on this log directory."""


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


def clean_copy(logs_dir: str, out_dir: str) -> list[int]:
    """Copy the usable lines of ``logs_dir``'s database into ``out_dir``, renumbering workload references
    around dropped workload lines. Returns the line number in ``logs_dir`` of each record kept."""
    wl_lines = _read_lines(os.path.join(logs_dir, WORKLOADS), _check_workload)
    new_index, kept_wl = {}, []
    for old, (_, line) in enumerate(wl_lines):
        if line is not None:
            new_index[old] = len(kept_wl)
            kept_wl.append(line)
    kept_rec, rec_numbers = [], []
    rec_path = os.path.join(logs_dir, RECORDS)
    if os.path.exists(rec_path):
        for number, line in _read_lines(rec_path, _check_record):
            if line is None:
                continue
            entry = json.loads(line)
            if entry[0] not in new_index:
                warnings.warn(f"{rec_path}:{number}: record refers to workload {entry[0]}, which is missing or "
                              "corrupt; skipped", TuningLogWarning, stacklevel=2)
                continue
            kept_rec.append(json.dumps([new_index[entry[0]], entry[1]]) + "\n")
            rec_numbers.append(number)
    with open(os.path.join(out_dir, WORKLOADS), "w") as f:
        f.writelines(kept_wl)
    with open(os.path.join(out_dir, RECORDS), "w") as f:
        f.writelines(kept_rec)
    return rec_numbers


_LOADED: dict = {}  # (logs dir, size and mtime of its files) -> database: each compile need not re-parse MBs


def _file_stamp(logs_dir: str) -> tuple:
    stamp = [logs_dir]
    for name in (WORKLOADS, RECORDS):
        path = os.path.join(logs_dir, name)
        st = os.stat(path) if os.path.isfile(path) else None
        stamp.append((st.st_size, st.st_mtime_ns) if st else None)
    return tuple(stamp)


def load_database(logs_dir: str):
    """A read-only MetaSchedule database of the usable records in ``logs_dir``, or None (with a warning).
    Loaded once per process while the files stay unchanged."""
    logs_dir = os.fspath(logs_dir)
    if not os.path.isfile(os.path.join(logs_dir, WORKLOADS)):
        warnings.warn(f"{logs_dir}: no tuning log ({WORKLOADS} missing); using default schedules",
                      TuningLogWarning, stacklevel=2)
        return None
    stamp = _file_stamp(logs_dir)
    if stamp not in _LOADED:
        database = _load(logs_dir)
        if database is None:
            return None
        _LOADED[stamp] = database
    return _LOADED[stamp]


def _load(logs_dir: str):
    with tempfile.TemporaryDirectory() as tmp:
        return _readable(logs_dir, tmp)[0]


def _readable(logs_dir: str, tmp: str):
    """(database, None) when TVM reads the usable lines of ``logs_dir`` (copied into ``tmp``) whole, else
    (database of the records it can read, the lines of ``tmp``'s record file that those are)."""
    from tvm.s_tir import meta_schedule as ms

    rec_numbers = clean_copy(logs_dir, tmp)
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
