"""Default schedules for kernels that have no tuned record.

CUDA: dlight's GPU rules (every kernel needs thread bindings to run at all on a GPU).
CPU: kernels keep the loop nests LegalizeOps wrote (correct, slow); tuned logs replace them.
"""
from __future__ import annotations

import tvm
from tvm.s_tir import dlight as dl


def gpu_rules() -> list:
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def apply_default_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    if target.kind.name == "cuda":
        with target:
            return dl.ApplyDefaultSchedule(*gpu_rules())(mod)
    return mod
