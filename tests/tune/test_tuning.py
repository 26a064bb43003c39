"""Tuning: a smoke run writes a resumable log that compile applies; corrupt logs warn and fall back; a lock
keeps two tuners apart; RPC measurement through a tracker; CUDA candidates build without a GPU."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tvmdm
from schedules import database
from tvmdm.tune import tuner as tune

pytestmark = pytest.mark.slow  # end to end, a minute or more in all (`pytest -m 'not slow'` skips it)

SHAPES = {"hidden_states": [2, 8, 32], "attention_mask": [2, 8]}


@pytest.fixture(scope="module")
def smoke_logs(tmp_path_factory, tiny_layer):
    logs = str(tmp_path_factory.mktemp("logs") / "tiny")
    summary = tune.tune(tiny_layer, logs=logs, trials=4, per_iter=2, shapes=SHAPES, name="bert-tiny-layer")
    return logs, summary


def test_smoke_tuning_writes_a_log(smoke_logs):
    logs, summary = smoke_logs
    # the paper level's kernels but SM, the context contraction and BDRLN (scheduled by hand, no record applies)
    assert summary["trials_run"] >= 4 and len(summary["tasks"]) == 5
    with open(os.path.join(logs, database.RECORDS)) as f:
        records = [json.loads(line) for line in f]
    assert len(records) >= 4
    meta = json.load(open(os.path.join(logs, "meta.json")))
    assert meta["target_kind"] == "llvm" and meta["trials"] >= 4 and meta["shapes"] == SHAPES
    assert meta["model"] == "bert-tiny-layer" and meta["tuning_seconds"] > 0
    # TVM's own lines (C++ warnings, TIR a task prints) go beside the records, not to the terminal
    assert os.path.isfile(os.path.join(logs, "logs", "native.log"))


def test_every_command_that_compiles_takes_the_logs_tune_wrote(smoke_logs, tiny_layer, tmp_path, capsys):
    """`tvmdm tune --logs DIR` writes what `--logs DIR` applies; --batch/--seq bind the tuned size."""
    import onnx

    from tvmdm.cli.main import main

    logs, _ = smoke_logs
    model = str(tmp_path / "layer.onnx")
    onnx.save(tiny_layer, model)
    applied = len(tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=logs).tuned_kernels)
    assert applied >= 1
    for extra, count in ((["--logs", logs], applied), (["--logs", "none"], 0)):
        assert main(["compile", model, "--batch", "2", "--seq", "8", "-o", str(tmp_path / "m.tvmdm"), *extra]) == 0
        assert f"kernels: {count} from tuning logs" in capsys.readouterr().out


def test_rerun_resumes_instead_of_starting_over(smoke_logs, tiny_layer, capsys):
    logs, summary = smoke_logs
    again = tune.tune(tiny_layer, logs=logs, trials=4, shapes=SHAPES)
    assert again["trials_run"] == 0 and again["trials_in_log"] >= 4
    assert f"trials already in {logs}; running 0" in capsys.readouterr().err


def test_compile_applies_the_log(smoke_logs, tiny_layer):
    logs, _ = smoke_logs
    with open(os.path.join(logs, database.RECORDS)) as f:
        tuned_workloads = {json.loads(line)[0] for line in f}
    compiled = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=logs)
    # Every workload with a record got its tuned schedule (the rest the default one).
    assert len(compiled.tuned_kernels) == len(tuned_workloads) >= 1
    assert set(compiled.tuned_kernels) <= set(compiled.kernels)
    assert compiled.check(tvmdm.random_inputs(compiled, batch=2, seq=8)).ok
    untuned = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=None)
    assert untuned.tuned_kernels == []


def test_corrupt_log_warns_with_file_and_line_and_falls_back(smoke_logs, tiny_layer, tmp_path):
    logs, _ = smoke_logs
    bad = tmp_path / "bad"
    shutil.copytree(logs, bad)
    records = bad / database.RECORDS
    lines = records.read_text().splitlines(keepends=True)
    lines.insert(1, "{this is not json\n")
    text = "".join(lines)
    records.write_text(text[: len(text) - 40])  # and the last record cut short, as by a kill mid-write
    with pytest.warns(database.TuningLogWarning) as caught:
        compiled = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=str(bad))
    messages = [str(w.message) for w in caught]
    assert any(f"{records}:2: corrupt tuning log line skipped" in m for m in messages), messages
    assert any(f"{records}:{len(lines)}: corrupt tuning log line skipped" in m for m in messages), messages
    assert compiled.check(tvmdm.random_inputs(compiled, batch=2, seq=8)).ok
    (bad / database.WORKLOADS).write_text("garbage\n")
    with pytest.warns(database.TuningLogWarning, match=r"database_workload.json:1: corrupt"):
        compiled = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=str(bad))
    assert compiled.tuned_kernels == []


UNREADABLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "unreadable_record")


def test_record_tvm_cannot_read_back_is_skipped_not_the_whole_log(tmp_path):
    """tests/data/unreadable_record: a good record (line 1) and one TVM 0.27 wrote while tuning a column
    reduction but cannot load (line 2). Stock JSONDatabase rejects the whole log; ours drops that line only."""
    from tvm.s_tir import meta_schedule as ms

    logs = tmp_path / "logs"
    shutil.copytree(UNREADABLE, logs)
    with pytest.raises(Exception, match="parallel_for_dynamic"):  # the trap (an upgrade may fix it)
        ms.database.JSONDatabase(work_dir=str(logs), allow_missing=False)
    with pytest.warns(database.TuningLogWarning, match=r"database_tuning_record.json:2: tuning record TVM cannot"):
        loaded = database.load_database(str(logs))
    assert loaded is not None and len(loaded) == 1


def test_missing_log_directory_warns(tiny_layer, tmp_path):
    with pytest.warns(database.TuningLogWarning, match=r"no tuning log"):
        compiled = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=str(tmp_path / "nowhere"))
    assert compiled.tuned_kernels == []


def test_a_symbolic_module_reads_no_log(smoke_logs, tiny_layer, monkeypatch):
    """No record matches a kernel with symbolic dims: the logs are not even parsed, and the user hears why."""
    logs, _ = smoke_logs
    import schedules.logs

    monkeypatch.setattr(schedules.logs, "load_database", lambda *a, **k: pytest.fail("a log was read"))
    with pytest.warns(database.TuningLogWarning, match=r"not read: records are for static shapes"):
        compiled = tvmdm.compile(tiny_layer, tuning_logs=logs)
    assert compiled.tuned_kernels == []


def test_second_tuner_is_refused(tmp_path):
    logs = str(tmp_path / "shared")
    with database.locked(logs):
        code = ("import sys\nfrom schedules.database import locked, LogsInUseError\n"
                f"try:\n    locked({logs!r}).__enter__()\nexcept LogsInUseError as e:\n    print(e); sys.exit(3)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert f"{logs} is being tuned by another process (pid {os.getpid()})" in proc.stdout
    with database.locked(logs):  # released: the next tuner gets it
        pass


def test_symbolic_shapes_are_refused_for_tuning(tiny_layer, tmp_path):
    with pytest.raises(ValueError, match=r"have symbolic dims: bind them"):
        tune.tune(tiny_layer, logs=str(tmp_path / "x"), trials=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_tracker_with_two_servers(tiny_layer, tmp_path):
    import psutil

    port = _free_port()
    python = sys.executable
    log = open(tmp_path / "rpc.log", "w")
    procs = [subprocess.Popen([python, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                               "--port-end", str(port + 1)], stdout=log, stderr=log)]
    try:
        for i in range(2):
            procs.append(subprocess.Popen([python, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
                                           "--key", "tvmdm-test", "--host", "127.0.0.1", "--port", str(9300 + 10 * i),
                                           "--port-end", str(9309 + 10 * i)], stdout=log, stderr=log))
        try:
            _wait_for_servers(port, "tvmdm-test", 2)
        except TimeoutError:
            log.flush()
            raise AssertionError((tmp_path / "rpc.log").read_text()[-3000:]) from None
        logs = str(tmp_path / "rpc")
        summary = tune.tune(tiny_layer, logs=logs, trials=2, per_iter=2, shapes=SHAPES,
                            rpc_tracker=f"127.0.0.1:{port}", rpc_key="tvmdm-test")
        measured = [ms for ms in summary["best_ms"].values() if np.isfinite(ms)]
        assert measured, summary  # the candidates ran on the RPC servers
    finally:
        # the tracker and servers each run their sessions in a TVM popen worker, which outlives a terminated
        # parent (3 processes of ~530 MB were left after every suite): end those too
        workers = [w for p in procs if p.poll() is None for w in psutil.Process(p.pid).children(recursive=True)]
        for p in procs[::-1]:
            p.terminate()
            p.wait(timeout=30)
        for worker in workers:
            worker.terminate()
        psutil.wait_procs(workers, timeout=10)


def _wait_for_servers(port: int, key: str, count: int, timeout_s: float = 120) -> None:
    from tvm import rpc

    deadline = time.time() + timeout_s
    while time.time() < deadline:  # the tracker's port opens once it has imported TVM
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    while time.time() < deadline:
        if rpc.connect_tracker("127.0.0.1", port).summary()["queue_info"].get(key, {}).get("free", 0) >= count:
            return
        time.sleep(1)
    raise TimeoutError(f"{count} RPC servers with key {key} did not register in {timeout_s}s")


def test_bad_rpc_arguments():
    with pytest.raises(ValueError, match=r"--rpc-tracker must be HOST:PORT and --rpc-key given"):
        tune.make_runner("localhost", None)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_metaschedule_cuda_candidates_build_here(tiny_layer, arch):
    """MetaSchedule's CUDA search space samples a schedule for a matmul kernel; it builds to CUDA source
    without a GPU (measuring needs one: that is the GPU run script's job)."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    tasks, target = tune.extract_tasks(tiny_layer, f"cuda:{arch}", SHAPES)
    task = next(t for t in tasks if "matmul" in t.task_name)
    context = ms.TuneContext(mod=task.dispatched[0], target=target, space_generator="post-order-apply",
                             search_strategy="replay-trace", task_name=task.task_name, num_threads=1)
    spaces = context.generate_design_space()
    assert spaces
    builder = tune.make_builder(timeout_s=300)  # CUDA codegen in a fresh worker: slow on a busy machine
    results = builder.build([ms.builder.BuilderInput(spaces[0].mod, target)])
    assert results[0].error_msg is None, results[0].error_msg
    # A sampled schedule binds its loops to GPU blocks/threads (split factors vary by sample; a sample whose bound
    # extents are all 1 prints no threadIdx in the CUDA source, so check the bindings in the scheduled TIR).
    scheduled = spaces[0].mod.script()
    assert 'thread_binding' in scheduled and ('"blockIdx.x"' in scheduled or '"threadIdx.x"' in scheduled)
    lib = tvm.compile(spaces[0].mod, target=target)
    source = lib.mod.imports[0].inspect_source()
    assert "__global__" in source and "extern \"C\"" in source


def test_kill_stops_the_tuner_like_ctrl_c_within_seconds_and_keeps_records_and_time(tmp_path):
    """SIGTERM mid-run: the tuner builds nothing more and exits within 10 s (it once waited out its batch in
    flight, over 60 s), exit code 130, every measured batch stays in the log, meta.json counts them and the
    time spent, the lock is released (a rerun continues from them)."""
    import signal

    logs = str(tmp_path / "killed")
    output = open(tmp_path / "tune.err", "w+")  # a file, not a pipe: an unread pipe fills and blocks the tuner
    proc = subprocess.Popen([sys.executable, "-m", "tvmdm", "tune", "bert-tiny-layer", "--logs", logs,
                             "--trials", "400", "--per-iter", "4", "--batch", "2", "--seq", "8"],
                            stdout=subprocess.DEVNULL, stderr=output, text=True)
    records = os.path.join(logs, database.RECORDS)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.isfile(records) and sum(1 for _ in open(records)) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, (tmp_path / "tune.err").read_text()[-2000:]
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = (tmp_path / "tune.err").read_text()
    assert time.time() - signalled < 10, err[-2000:]
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted: the records measured so far are in" in err
    lines = [json.loads(line) for line in open(records)]
    meta = json.load(open(os.path.join(logs, "meta.json")))
    assert len(lines) >= 2 and meta["trials"] == len(lines) and meta["tuning_seconds"] > 0
    assert all(min(line[1][1]) < 1e9 for line in lines)  # measured candidates only, none the stop left unbuilt
    with database.locked(logs):  # released: a rerun may take it
        pass


def test_a_deadline_shorter_than_one_round_still_leaves_records(tmp_path, capsys):
    # 8 tasks of 4 candidates: one round is far more than 3 s, but the first batch is in the log as soon as it
    # is measured (MetaSchedule's schedulers join it only when they next pick its task: after the round), and
    # past the deadline nothing more is searched for or built: exactly that batch.
    from tvmdm.tune.tuner import tune

    logs = str(tmp_path / "deadline")
    summary = tune(tvmdm.default_model("bert-tiny-layer"), logs=logs, trials=400, per_iter=4, seconds=3,
                   shapes={"hidden_states": [2, 8, 32], "attention_mask": [2, 8]})
    assert summary["stopped"] == "deadline of 3 s" and 1 <= summary["trials_run"] <= 4
    assert sum(1 for _ in open(os.path.join(logs, database.RECORDS))) == summary["trials_run"]
    assert "stopped (deadline of 3 s)" in capsys.readouterr().err


def test_a_rerun_on_a_half_written_log_sets_the_whole_file_aside_and_goes_on(smoke_logs, tiny_layer, tmp_path,
                                                                            capsys):
    """A kill mid-write leaves half a line: the tuner reads the log as compile does (TVM's own reader failed on
    it), keeps the damaged file whole as a backup and goes on from the usable records."""
    from tvm.s_tir import meta_schedule as ms

    logs = tmp_path / "cut"
    shutil.copytree(smoke_logs[0], logs)
    records = logs / database.RECORDS
    damaged = records.read_bytes()[:-40]
    records.write_bytes(damaged)
    usable = damaged.count(b"\n")
    with pytest.warns(database.TuningLogWarning, match=rf"{records}:{usable + 1}: corrupt tuning log line"):
        again = tune.tune(tiny_layer, logs=str(logs), trials=usable, shapes=SHAPES)
    assert again["trials_run"] == 0 and again["trials_in_log"] == usable
    backups = sorted(logs.glob(database.RECORDS + ".*.bak"))
    assert len(backups) == 1 and backups[0].read_bytes() == damaged  # nothing lost
    assert f"unusable lines left out of the log (the whole file is kept as {backups[0]})" in capsys.readouterr().err
    assert len(ms.database.JSONDatabase(work_dir=str(logs), allow_missing=False)) == usable  # TVM reads it whole
    assert database.repair(str(logs)) == []  # a clean log is left alone


def test_repair_drops_a_record_tvm_cannot_read_back(tmp_path):
    from tvm.s_tir import meta_schedule as ms

    logs = tmp_path / "logs"
    shutil.copytree(UNREADABLE, logs)
    with pytest.warns(database.TuningLogWarning, match="TVM cannot read back"):
        assert len(database.repair(str(logs))) == 2
    assert len(ms.database.JSONDatabase(work_dir=str(logs), allow_missing=False)) == 1


def test_a_second_tuner_on_the_cli_gets_one_line_and_exit_code_2(tmp_path, capsys):
    from tvmdm.cli.main import main

    logs = str(tmp_path / "shared")
    with database.locked(logs):
        code = main(["tune", "bert-tiny-layer", "--logs", logs, "--trials", "1", "--batch", "2", "--seq", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"tvmdm tune: error: {logs} is being tuned by another process")


def test_a_meta_json_that_is_not_json_stops_tuning_before_any_work_and_only_warns_compile(tmp_path, tiny_layer):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "meta.json").write_text("{half")
    with pytest.raises(database.TuningLogError, match=rf"{logs / 'meta.json'}: unreadable"):
        tune.tune(tiny_layer, logs=str(logs), trials=1, shapes=SHAPES)
    (logs / database.WORKLOADS).write_text("")
    with pytest.warns(database.TuningLogWarning, match=rf"{logs / 'meta.json'}: unreadable"):
        compiled = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=str(logs))
    assert compiled.check(tvmdm.random_inputs(compiled, batch=2, seq=8)).ok


def test_logs_that_are_a_file_are_refused(tmp_path, tiny_layer):
    (tmp_path / "f").write_text("")
    with pytest.raises(database.TuningLogError, match=rf"--logs {tmp_path / 'f'} is a file"):
        tune.tune(tiny_layer, logs=str(tmp_path / "f"), trials=1, shapes=SHAPES)


def test_records_labelled_for_another_target_are_left_out_with_a_warning(smoke_logs, tiny_layer, tmp_path):
    logs = tmp_path / "cuda"
    shutil.copytree(smoke_logs[0], logs)
    meta = json.loads((logs / "meta.json").read_text())
    (logs / "meta.json").write_text(json.dumps(dict(meta, target_kind="cuda", target=json.dumps({"kind": "cuda"}))))
    with pytest.warns(database.TuningLogWarning, match=rf"{logs}: tuned for cuda, not llvm: its records are not"):
        compiled = tvmdm.compile(tiny_layer, shapes=SHAPES, tuning_logs=str(logs))
    assert compiled.tuned_kernels == []
