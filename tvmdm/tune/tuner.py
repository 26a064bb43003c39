"""Tune the fused kernels of a model with MetaSchedule (XGBoost cost model) and write the records to a log.

    tvmdm tune MODEL --target llvm --trials 400 --logs tuning_logs/<name>

MODEL is an ONNX file or an embedded model name. The tasks are the kernels ``tvmdm.compile`` builds with the
same --fusion and --shape options, so the log applies to them. Resumable: --trials is the total wanted in the
log; a rerun only runs what is missing, and every measured batch is appended to the log at once, so an
interrupt loses at most the batch in flight. A lock keeps a second tuner off the same log.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from schedules.database import RECORDS, WORKLOADS, TuningLogError, load_database, locked, repair
from schedules.scheduler import STOPPED
from tvmdm.core import native_log
from tvmdm.core.extras import require
from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT

_INTERRUPTED: list[int] = []  # signals received by `tvmdm tune` (see _interrupt)


def extract_tasks(model, target, shapes=None, fusion=DEFAULT_FUSION, train: bool = False, only=None, layout=DEFAULT_LAYOUT,
                  precision: str = "fp32", keep_hand_written: bool = False):
    """(tuning tasks, the compile target) for ``model`` as tvmdm.compile (or, with ``train``,
    tvmdm.compile_train_step with an MSE loss) would build it. ``only``: keep the tasks whose name contains
    one of these strings (e.g. ["matmul"]: the contractions, where most of the time goes). On CPUs the kernels
    a hand-written rule takes at compile (the packed, bf16 and int8 contractions, SM, BDRLN, ...) are left out
    unless ``keep_hand_written``: no record of them would be applied."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from onnx_import import import_onnx
    from tvmdm.tune import metaschedule_fixes

    # MetaSchedule imports the tensor intrinsics while it builds design spaces: minutes of TVMScript parsing
    # once a process holds many modules (torch's) without this
    metaschedule_fixes.speed_up_tvmscript_parsing()
    from tvmdm.build.options import make_options
    from tvmdm.runtime.runner import TRANSFORM_PARAMS
    from tvmdm.train.fusion import training_fusion
    from tvmdm.train.step import training_graph
    from tvmdm.transform.fuse import fuse

    # No tuning logs: the contractions are tuned as stock fusion writes them, not packed for our micro-kernel.
    options = make_options(target, fusion=fusion, layout=layout, precision=precision, tuning_logs=None,
                           training=train)
    tvm_target = options.target
    if train:
        imported, mod, _, _ = training_graph(model, loss="mse", shapes=shapes, fusion=fusion, layout=layout,
                                             batched_attention=options.batched_attention)
    else:
        imported = import_onnx(model, shapes=shapes)
        mod = imported.mod
    symbolic = [f"{spec.name}{list(spec.shape)}" for spec in imported.inputs
                if any(isinstance(d, str) for d in spec.shape)]
    if symbolic:
        raise ValueError(f"inputs {symbolic} have symbolic dims: bind them (--batch/--seq or --shape NAME=D0xD1); "
                         "tuning measures one concrete size")
    fused, _ = fuse(mod, options, training_fusion(options) if train else None)
    # Weight packing (main_transform_params) runs once at load: nothing there is worth a trial.
    fused = tvm.IRModule({gv: f for gv, f in fused.functions_items() if gv.name_hint != TRANSFORM_PARAMS})
    tasks = ms.relax_integration.extract_tasks(fused, tvm_target)
    if tvm_target.kind.name == "llvm" and not keep_hand_written:  # what compile schedules by hand
        from schedules.pipeline import taken_by_hand

        tasks = [t for t in tasks if not taken_by_hand(t.dispatched[0]["main"], options)]
    if only:
        tasks = [t for t in tasks if any(key in t.task_name for key in only)]
    return tasks, tvm_target


def check_logs_dir(logs: str) -> None:
    """Before any work: ``logs`` is a directory (or can be made one) and its meta.json, if any, is readable
    (written again at the end of the run, it would fail only then)."""
    from schedules.logs import read_meta

    if os.path.exists(logs) and not os.path.isdir(logs):
        raise TuningLogError(f"--logs {logs} is a file; give the directory that holds (or will hold) the log")
    read_meta(logs)


def existing_trials(logs_dir: str, tasks) -> list[int]:
    """Records already in the log for each task (0 where the log lacks it)."""
    if not os.path.isfile(os.path.join(logs_dir, WORKLOADS)):
        return [0] * len(tasks)
    db = load_database(logs_dir)  # the reader compile uses: unusable lines skipped, each named in a warning
    counts = []
    for task in tasks:
        mod = task.dispatched[0]
        counts.append(len(db.get_top_k(db.commit_workload(mod), 1 << 30)) if db.has_workload(mod) else 0)
    return counts


class Progress:
    """Trials done, best latency per task and ETA, on one refreshed line (a line per batch when not a tty)."""

    def __init__(self, task_names, total: int, stream):
        self.names = task_names
        self.total = max(total, 1)
        self.best = [float("inf")] * len(task_names)
        self.done = 0
        self.start = time.perf_counter()
        self.stream = stream

    def update(self, task_id: int, run_secs: list[float]) -> None:
        self.done += len(run_secs)
        valid = [s for s in run_secs if s < float("inf")]
        if valid:
            self.best[task_id] = min(self.best[task_id], min(valid))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * max(self.total - self.done, 0)
        width = 24
        filled = int(width * min(self.done / self.total, 1.0))
        best = self.best[task_id]
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} trials  "
                f"{self.names[task_id][:40]}: best {best * 1e3:.3f} ms  elapsed {elapsed:.0f}s  ETA {eta:.0f}s")
        end = "\r" if self.stream.isatty() else "\n"
        self.stream.write(line + end)
        self.stream.flush()

    def summary(self) -> str:
        rows = [f"  {name}: {'untuned' if b == float('inf') else f'{b * 1e3:.3f} ms'}"
                for name, b in zip(self.names, self.best)]
        return "best per task (this run):\n" + "\n".join(rows)


def _progress_callback(progress: Progress):
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
    from tvm.ir.utils import derived_object

    @derived_object
    class ProgressCallback(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            secs = []
            for built, result in zip(builder_results, runner_results):
                if built.error_msg == STOPPED:  # never built: not a trial
                    continue
                if result.error_msg is None and result.run_secs:
                    secs.append(sum(float(s) for s in result.run_secs) / len(result.run_secs))
                else:
                    secs.append(float("inf"))
            if secs:
                progress.update(task_id, secs)

    return ProgressCallback()


def make_builder(timeout_s: int = 120):
    """LocalBuilder whose workers get the TVMScript parsing fix first (otherwise each worker spends 20-50 s
    importing tensor intrinsics; see tvmdm.tune.metaschedule_fixes.speed_up_tvmscript_parsing)."""
    from tvm.s_tir import meta_schedule as ms

    from tvmdm.tune import metaschedule_fixes
    from tvmdm.core.target import num_cores

    return ms.builder.LocalBuilder(max_workers=num_cores(), timeout_sec=timeout_s,
                                   initializer=metaschedule_fixes.speed_up_tvmscript_parsing)


def make_runner(rpc_tracker: str | None, rpc_key: str | None, timeout_s: int = 30):
    from tvm.s_tir import meta_schedule as ms

    if rpc_tracker is None:
        return "local"
    host, _, port = rpc_tracker.rpartition(":")
    if not host or not port.isdigit() or not rpc_key:
        raise ValueError(f"--rpc-tracker must be HOST:PORT and --rpc-key given (got {rpc_tracker!r}, {rpc_key!r})")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=rpc_key,
                                 session_timeout_sec=timeout_s)
    return ms.runner.RPCRunner(rpc_config=config, evaluator_config=ms.runner.EvaluatorConfig(
        number=3, repeat=1, min_repeat_ms=50, enable_cpu_cache_flush=False))


def tune(model, *, logs: str, target="llvm", trials: int = 64, shapes=None, fusion=DEFAULT_FUSION, per_iter: int = 8,
         rpc_tracker=None, rpc_key=None, seed: int | None = 0, stream=None, name: str | None = None,
         train: bool = False, only=None, layout: str = DEFAULT_LAYOUT, precision: str = "fp32",
         seconds: float | None = None) -> dict:
    """Tune until the log holds ``trials`` records for the model's tasks, or until ``seconds`` have passed or
    a signal came (see _interrupt): every batch is in the log as soon as it is measured (schedules.scheduler),
    and a stop builds nothing more. Returns a summary dict ("stopped": why it ended early, or None)."""
    from tvm.s_tir import meta_schedule as ms

    from schedules.scheduler import JoinEachBatch, StoppableBuilder, measure_callbacks
    from tvmdm.tune import metaschedule_fixes
    from tvmdm.core.target import num_cores

    stream = stream or native_log.CurrentStderr()
    require("tune", "tuning")
    if rpc_tracker is not None:
        require("rpc", "tuning over RPC")
    check_logs_dir(logs)
    deadline = None if seconds is None else time.perf_counter() + seconds

    def stopped() -> str | None:
        if _INTERRUPTED:
            return f"signal {_INTERRUPTED[0]}"
        # Past the deadline nothing new is searched for or built once a batch is measured (a run that ended with
        # no record would have thrown all its time away); before it, the builder starts no chunk that the
        # earlier chunks say would end after it (StoppableBuilder).
        late = deadline is not None and progress.done > 0 and (
            time.perf_counter() > deadline or builder.out_of_time)
        return f"deadline of {seconds:g} s" if late else None

    with native_log.to_log(os.path.join(logs, "logs", "native.log")):
        tasks, tvm_target = extract_tasks(model, target, shapes, fusion, train, only, layout, precision)
    if not tasks:
        raise ValueError(f"no tuning task left (--only {only})")
    names = [t.task_name for t in tasks]
    with locked(logs):
        for backup in repair(logs):
            stream.write(f"unusable lines left out of the log (the whole file is kept as {backup})\n")
        have = existing_trials(logs, [t for t in tasks])
        remaining = trials - sum(have)
        stream.write(f"{len(tasks)} tasks; {sum(have)} trials already in {logs}; running {max(remaining, 0)}\n")
        if remaining <= 0:
            return {"tasks": names, "trials_run": 0, "trials_in_log": sum(have)}
        progress = Progress(names, remaining, stream)
        metaschedule_fixes.reset_metaschedule_logging()
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            tasks, logs, strategy="evolutionary", num_threads=num_cores(), seed=seed)
        contexts, weights = drop_unschedulable(contexts, weights, stream, seed)
        database = ms.database.JSONDatabase(work_dir=logs)
        stop = lambda: stopped() is not None  # noqa: E731
        builder = StoppableBuilder(make_builder(), stop, num_cores(), deadline, measured=lambda: progress.done > 0)
        try:
            # MetaSchedule's task logs (TIR included) and TVM's C++ lines beside the records, not on the terminal
            with native_log.to_log(os.path.join(logs, "logs", "native.log")):
                ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=logs,
                              max_trials_global=remaining, num_trials_per_iter=per_iter, database=database,
                              builder=builder,
                              runner=make_runner(rpc_tracker, rpc_key), cost_model="xgb",
                              measure_callbacks=measure_callbacks(_progress_callback(progress)),
                              task_scheduler=JoinEachBatch(stop))
        finally:  # a stopped run's trials and time count too
            stream.write("\n" + progress.summary() + "\n")
            _write_meta(logs, name or model, tvm_target, shapes, fusion, time.perf_counter() - progress.start,
                        "training step" if train else "inference", precision)
        why = stopped()
        if why:
            stream.write(f"stopped ({why}): {progress.done} trials measured, all in {logs}\n")
        return {"tasks": names, "trials_run": progress.done, "trials_in_log": sum(have) + progress.done,
                "best_ms": dict(zip(names, [b * 1e3 for b in progress.best])), "stopped": why}


def _without_consumer_fusion(ctx, seed):
    """The same task in MetaSchedule's default space, except that multi-level tiling does not try to fuse the
    tiled block's consumer into its tiles (its reverse_compute_at step raises on the paper's fused kernels);
    RandomComputeLocation still places the consumers."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.schedule_rule import MultiLevelTiling, ReuseType

    kind = ctx.target.kind.name
    if kind == "cuda":
        mlt = MultiLevelTiling(structure="SSSRRSRS", tile_binds=["blockIdx.x", "vthread.x", "threadIdx.x"],
                               max_innermost_factor=64, vector_load_lens=[1, 2, 3, 4, 8, 16],
                               reuse_read=ReuseType(req="must", levels=[4], scope="shared"), reuse_write=None)
    else:
        mlt = MultiLevelTiling(structure="SSRSRS", max_innermost_factor=64, reuse_write=None)
    rules = [mlt if type(r).__name__ == "MultiLevelTiling" else r for r in ms.ScheduleRule.create(kind)]
    space = ms.space_generator.PostOrderApply(sch_rules=rules, postprocs=kind, mutator_probs=kind)
    return ms.TuneContext(mod=ctx.mod, target=ctx.target, space_generator=space, search_strategy="evolutionary",
                          task_name=ctx.task_name, rand_state=seed if seed is not None else -1,
                          num_threads=ctx.num_threads)


def drop_unschedulable(contexts, weights, stream, seed=0):
    """MetaSchedule aborts the whole run when one task's design space cannot be generated. In 0.27 its
    multi-level tiling raises in reverse_compute_at on the paper's fused kernels (sm, bdrln: a reduction
    whose consumer also reads other reductions); those are tuned in a space without that consumer fusion. A
    task that fails there too is left out with a warning (it keeps the default schedule)."""
    kept = []
    for ctx, weight in zip(contexts, weights):
        for attempt in (ctx, None):
            if attempt is None:
                attempt = _without_consumer_fusion(ctx, seed)
            try:
                attempt.generate_design_space()
            except Exception as err:  # noqa: BLE001 - any failure there would kill the run
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                problem = first[:160]
                continue
            if attempt is not ctx:
                stream.write(f"note: task {ctx.task_name} tuned without consumer fusion in tiling ({problem})\n")
            kept.append((attempt, weight))
            break
        else:
            stream.write(f"warning: task {ctx.task_name} cannot be tuned (design space: {problem}); "
                         "it keeps the default schedule\n")
    if not kept:
        raise ValueError("no task can be tuned (every design space failed)")
    return [c for c, _ in kept], [w for _, w in kept]


def _records_in(logs: str) -> int:
    path = os.path.join(logs, RECORDS)
    return sum(1 for line in open(path) if line.strip()) if os.path.isfile(path) else 0


def _write_meta(logs, model, target, shapes, fusion, seconds: float, graph: str, precision: str = "fp32") -> None:
    """meta.json beside the database: what was tuned, for which target, and how long it took (cumulative)."""
    import json
    import platform

    from schedules.logs import META, read_meta

    path = os.path.join(logs, META)
    previous = read_meta(logs) or {}
    meta = {
        "model": model if isinstance(model, str) else getattr(getattr(model, "graph", None), "name", "model"),
        "target_kind": target.kind.name,
        "target": str(target),
        "shapes": {k: list(v) for k, v in (shapes or {}).items()},
        "fusion": fusion,
        "precision": precision,
        "graph": graph,
        "trials": _records_in(logs),  # the whole log, whichever tasks this run tuned
        "tuning_seconds": round(previous.get("tuning_seconds", 0.0) + seconds, 1),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
    }
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(path + ".tmp", path)


def _interrupt(signum, frame):
    # Only a flag: raised from here, the exception could land in a Python callback that C++ calls where it
    # cannot propagate (the XGBoost cost model's) and the process dies in std::terminate. The builder stops
    # at its next chunk and the scheduler picks no next task (schedules.scheduler); tune_tasks then returns.
    _INTERRUPTED.append(signum)


def run_tuning(model, *, logs: str, **tune_args) -> int:
    """``tune`` as a long run a person may stop: SIGTERM and Ctrl-C end it within seconds with every measured
    batch in the log. Returns the exit code (130 when stopped)."""
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops as cleanly as Ctrl-C
    signal.signal(signal.SIGINT, _interrupt)
    try:
        tune(model, logs=logs, **tune_args)
    except (KeyboardInterrupt, Exception) as err:  # noqa: BLE001 - re-raised unless a signal caused it
        if not isinstance(err, KeyboardInterrupt) and not _INTERRUPTED:
            raise
    if _INTERRUPTED:  # every measured batch is already in the log
        print(f"\ninterrupted: the records measured so far are in {logs}; rerun the same command to "
              "continue", file=sys.stderr)
        return 130
    return 0
