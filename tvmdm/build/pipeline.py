"""The one path from a Relax module to an executable, for inference and training alike:
fuse (tvmdm.transform.fuse) -> schedule (schedules.pipeline) -> relax.build."""
from __future__ import annotations

import dataclasses
import time

import tvm
from tvm import relax

from schedules.amx import uses_amx
from schedules.pipeline import apply_schedules, hand_kernels, tuned_kernels
from schedules.rule import kernels
from tvmdm.core import native_log
from tvmdm.core.options import Options
from tvmdm.transform.fuse import TrainingFusion, fuse
from tvmdm.transform.ir import op_name


@dataclasses.dataclass
class Built:
    """An executable and what was learnt making it: the fused, scheduled module (for analysis and profiling),
    kernel -> graph ops it covers, kernel -> {input index: share read} of packed inputs, the kernels scheduled
    from tuning records and by hand-written rules, and seconds per stage."""

    executable: object
    mod: tvm.IRModule
    kernel_ops: dict
    read_fractions: dict
    tuned_kernels: list
    hand_kernels: list
    timings: dict
    uses_amx: bool = False  # kernels on the AMX tile units: the process must ask for the tile state


def schedule(mod: tvm.IRModule, options: Options, training: TrainingFusion | None = None):
    """fuse + schedule: the scheduled module and the FusionRecord."""
    fused, record = fuse(mod, options, training)
    return apply_schedules(options)(fused), record


def build(mod: tvm.IRModule, options: Options, training: TrainingFusion | None = None) -> Built:
    timings = {}
    with native_log.to_log():  # TVM's C++ warnings (codegen, TOPI) to the log, not the terminal
        t0 = time.perf_counter()
        scheduled, record = schedule(mod, options, training)
        timings["fuse+schedule"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        executable = relax.build(scheduled, target=options.target)
        timings["build"] = time.perf_counter() - t0
    kernel_ops = {k: record.kernel_ops.get(k, [op_name(k)]) for k in kernels(scheduled)}
    return Built(executable, scheduled, kernel_ops, record.read_fractions, tuned_kernels(scheduled),
                 hand_kernels(scheduled), timings, uses_amx(scheduled))
