"""MetaSchedule parts that keep a tuning run's work when it is cut short (a deadline, Ctrl-C, SIGTERM).

MetaSchedule's task schedulers join a task's measured batch (run its measure callbacks, which write the records
to the database) only when they pick that task again; in the warm-up round that is after every other task
has had its first batch. On bert-tiny-layer with a 150 s deadline that left 0 records after 210 s, and the
builder's batch in flight kept SIGINT waiting over 60 s. Here:

- ``JoinEachBatch`` joins every batch as soon as it has been sent (its records are in the database before the
  next batch is searched for) and gives no new task once ``stop()`` says so;
- ``StoppableBuilder`` builds a batch a pool's worth of candidates at a time and builds no more once
  ``stop()`` says so, nor a chunk that the chunks before it say would end after the deadline; the candidates
  it skipped come back as STOPPED build errors,
- which ``CommitMeasured`` leaves out of the database (MetaSchedule's AddToDatabase would store them as
  1e10 s records, counted as trials and never retried).

So an interrupt stops the run within one chunk of builds (a few seconds), keeping everything measured.
"""
from __future__ import annotations

import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.s_tir.meta_schedule.task_scheduler import PyTaskScheduler

STOPPED = "not built: the tuning run was stopped"


@derived_object
class JoinEachBatch(PyTaskScheduler):
    """Warm-up: every task once, in order; then the task with the largest weighted best latency (where the
    model's time goes: the gradient scheduler's aim without its look-back window), each batch joined at once."""

    def __init__(self, stop):
        super().__init__()
        self.stop = stop
        self.turn = 0

    def next_task_id(self) -> int:
        outer = self._outer()
        tasks = outer.tasks_
        for task_id, task in enumerate(tasks):
            if task.runner_futures is not None:  # the batch just sent: its records go to the database now
                self.join_running_task(task_id)
        live = [i for i, task in enumerate(tasks) if not task.is_terminated]
        if not live or self.stop():
            return -1
        if self.turn < len(tasks):  # warm-up round
            self.turn += 1
            if not tasks[self.turn - 1].is_terminated:
                return self.turn - 1
            return self.next_task_id()

        def weighted_best(i):
            latencies = [float(x) for x in tasks[i].latency_ms]
            return tasks[i].task_weight * (min(latencies) if latencies else float("inf"))

        return max(live, key=weighted_best)


@derived_object
class StoppableBuilder(PyBuilder):
    """``inner`` (a LocalBuilder) on ``chunk`` candidates at a time, none after ``stop()``. With a ``deadline``
    (a ``clock()`` time), once ``measured()`` says a batch is in the log, a chunk starts only if the longest
    chunk so far would end before the deadline: the run stops starting builds that cannot finish in time
    instead of overrunning by them. Until then it builds (a run that measures nothing wastes all its time)."""

    def __init__(self, inner, stop, chunk: int, deadline: float | None = None, measured=lambda: True,
                 clock=time.perf_counter):
        super().__init__()
        self.inner, self.stop, self.chunk = inner, stop, max(1, chunk)
        self.deadline, self.measured, self.clock = deadline, measured, clock
        self.longest_chunk = 0.0  # seconds
        self.out_of_time = False  # a chunk was refused for the deadline: the run may as well end

    def fits_before_deadline(self) -> bool:
        return self.deadline is None or not self.measured() or \
            self.clock() + self.longest_chunk <= self.deadline

    def build(self, build_inputs):
        results = []
        for start in range(0, len(build_inputs), self.chunk):
            if self.stop() or not self.fits_before_deadline():
                self.out_of_time = self.out_of_time or not self.fits_before_deadline()
                results += [BuilderResult(None, STOPPED) for _ in build_inputs[start:]]
                break
            t0 = self.clock()
            results += list(self.inner.build(build_inputs[start:start + self.chunk]))
            self.longest_chunk = max(self.longest_chunk, self.clock() - t0)
        return results


@derived_object
class CommitMeasured(PyMeasureCallback):
    """MetaSchedule's AddToDatabase, except for the candidates a stop left unbuilt."""

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        database = task_scheduler.database_
        if database is None:
            return
        ctx = task_scheduler.tasks_[task_id].ctx
        workload = database.commit_workload(ctx.mod)
        for candidate, built, result in zip(measure_candidates, builder_results, runner_results):
            if built.error_msg == STOPPED:
                continue
            run_secs = list(result.run_secs) if result.run_secs is not None else [1e10]
            database.commit_tuning_record(ms.database.TuningRecord(
                candidate.sch.trace, workload, run_secs, ctx.target, candidate.args_info))


def measure_callbacks(*extra) -> list:
    """CommitMeasured in place of AddToDatabase among MetaSchedule's default callbacks, then ``extra``."""
    return [CommitMeasured(), ms.measure_callback.RemoveBuildArtifact(), ms.measure_callback.UpdateCostModel(),
            *extra]
