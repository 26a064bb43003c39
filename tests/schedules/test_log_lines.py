"""schedules.log_lines: the pruning a compile and the wheel's build apply (the fastest measured record of each
workload, the workloads that have one, references renumbered)."""
import json

from schedules.log_lines import RECORDS, WORKLOADS, clean_copy, prune_directory


def _record(seconds):
    return [[["trace"]], seconds, {"kind": "llvm"}, []]


def _write(path, workloads, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / WORKLOADS).write_text("".join(json.dumps([f"h{i}", w]) + "\n" for i, w in enumerate(workloads)))
    (path / RECORDS).write_text("".join(json.dumps([i, r]) + "\n" for i, r in records))
    (path / "meta.json").write_text('{"target_kind": "llvm"}')


def test_best_only_keeps_the_fastest_measured_record_of_each_workload(tmp_path):
    _write(tmp_path / "log", ["a", "b", "c"], [
        (0, _record([3e-3, 3e-3])), (0, _record([1e-3, 2e-3])), (0, _record([1e10])),  # a: the 1.5 ms one
        (1, _record([1e10])),  # b: only a failed build: no record, and its workload goes
        (2, _record([5e-3])),
    ])
    out = tmp_path / "out"
    out.mkdir()
    kept = clean_copy(str(tmp_path / "log"), str(out), best_only=True)
    assert kept == [2, 5]  # the line numbers of the kept records
    workloads = [json.loads(line)[1] for line in (out / WORKLOADS).read_text().splitlines()]
    records = [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]
    assert workloads == ["a", "c"]
    assert [(i, r[1]) for i, r in records] == [(0, [1e-3, 2e-3]), (1, [5e-3])]


def test_without_best_only_every_usable_line_stays(tmp_path):
    _write(tmp_path / "log", ["a", "b"], [(0, _record([1e-3])), (0, _record([2e-3])), (1, _record([1e10]))])
    out = tmp_path / "out"
    out.mkdir()
    assert clean_copy(str(tmp_path / "log"), str(out)) == [1, 2, 3]


def test_prune_directory_copies_meta_and_counts(tmp_path):
    _write(tmp_path / "log", ["a"], [(0, _record([2e-3])), (0, _record([1e-3]))])
    assert prune_directory(str(tmp_path / "log"), str(tmp_path / "pruned")) == (2, 1)
    assert json.loads((tmp_path / "pruned" / "meta.json").read_text()) == {"target_kind": "llvm"}
