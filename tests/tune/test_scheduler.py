"""schedules.scheduler.StoppableBuilder on a fake clock: what a tuner's deadline promises about builds."""
from schedules.scheduler import STOPPED, StoppableBuilder


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class SlowBuilder:
    """Each candidate takes ``seconds`` on the fake clock; records what it was asked to build."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds, self.built = clock, seconds, []

    def build(self, inputs):
        from tvm.s_tir.meta_schedule.builder import BuilderResult

        self.built += [len(self.built) + i for i in range(len(inputs))]
        self.clock.now += self.seconds * len(inputs)
        return [BuilderResult(None, None) for _ in inputs]


def _inputs(n):
    import tvm
    from tvm import te
    from tvm.s_tir.meta_schedule.builder import BuilderInput

    a = te.placeholder((4,), name="a")
    mod = tvm.IRModule({"main": te.create_prim_func([a, te.compute((4,), lambda i: a[i] * 2, name="b")])})
    return [BuilderInput(mod, tvm.target.Target({"kind": "llvm"})) for _ in range(n)]


def _builder(deadline, measured=True, seconds=10.0):
    clock = FakeClock()
    inner = SlowBuilder(clock, seconds)
    return StoppableBuilder(inner, lambda: False, chunk=2, deadline=deadline, measured=lambda: measured,
                            clock=clock), inner, clock


def test_no_chunk_starts_that_the_chunks_before_it_say_would_end_after_the_deadline():
    builder, inner, clock = _builder(deadline=45.0)
    results = builder.build(_inputs(8))  # chunks of 2 x 10 s: 0-20, 20-40, then 40-60 would overrun
    assert inner.built == [0, 1, 2, 3] and clock.now == 40.0 <= 45.0
    assert [r.error_msg for r in results] == [None] * 4 + [STOPPED] * 4
    assert builder.out_of_time  # the tuner ends the run instead of searching for batches it cannot build


def test_before_the_first_measured_batch_the_deadline_does_not_stop_builds():
    builder, inner, clock = _builder(deadline=5.0, measured=False)
    results = builder.build(_inputs(4))
    assert inner.built == [0, 1, 2, 3] and all(r.error_msg is None for r in results) and not builder.out_of_time


def test_without_a_deadline_everything_is_built():
    builder, inner, _ = _builder(deadline=None)
    builder.build(_inputs(6))
    assert inner.built == list(range(6))
