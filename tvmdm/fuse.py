"""Fusion: Relax graph -> fused TIR kernels.

Levels (``fusion=`` in compile):
  "none" - every operator its own kernel (the unfused baseline the paper measures against),
  "tvm"  - TVM's stock FuseOps/FuseTIR.
Each level is a ``tvm.transform.Sequential`` of Relax passes (IRModule -> IRModule).
"""
from __future__ import annotations

import re

import tvm
from tvm import relax, tirx

FUSION_LEVELS = ("none", "tvm")


def lowering_passes() -> list:
    """Graph ops -> TIR PrimFuncs, with op patterns annotated for fusion.

    FastMathTransform swaps erf, exp and softmax for TVM's polynomial versions (fast_erf is within 4.2e-7
    of float64 erf over [-6, 6], measured): exact erf costs as much as the FFN contraction it is fused with."""
    return [
        relax.transform.FastMathTransform(),
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
    ]


def op_name(prim_func_name: str) -> str:
    """LegalizeOps names a PrimFunc after its op, numbered when shapes differ: "add3" -> "add"."""
    return re.sub(r"\d+$", "", prim_func_name)


def record_kernel_ops(provenance: dict) -> tvm.transform.Pass:
    """Analysis pass (returns the module unchanged): for every kernel FuseTIR will make, the ops it covers.
    Run after FuseOps; fills ``provenance[kernel name] = [op, ...]``."""
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def called_prims(func) -> list[str]:
        names = []

        def visit(expr):
            if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
                names.append(op_name(expr.args[0].name_hint))

        relax.analysis.post_order_visit(func.body, visit)
        return names

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.RecordKernelOps")
    def record(mod, _ctx):
        for gv, func in mod.functions.items():
            if isinstance(func, tirx.PrimFunc):
                provenance.setdefault(gv.name_hint, [op_name(gv.name_hint)])
            elif isinstance(func, relax.Function) and func.attrs is not None and "Primitive" in func.attrs:
                provenance[gv.name_hint] = called_prims(func)
        return mod

    return record


def fusion_pipeline(fusion: str = "tvm", provenance: dict | None = None) -> tvm.transform.Pass:
    """The Sequential pass for a fusion level; ``provenance`` (a dict) receives kernel -> ops."""
    if fusion not in FUSION_LEVELS:
        raise ValueError(f"unknown fusion level {fusion!r}; choose one of {list(FUSION_LEVELS)}")
    provenance = {} if provenance is None else provenance
    passes = lowering_passes()
    if fusion == "tvm":
        passes += [relax.transform.FuseOps(), record_kernel_ops(provenance), relax.transform.FuseTIR()]
    else:
        passes.append(record_kernel_ops(provenance))
    passes.append(relax.transform.DeadCodeElimination())
    return tvm.transform.Sequential(passes, name=f"tvmdm.fuse.{fusion}")


def fuse(mod: tvm.IRModule, fusion: str = "tvm", provenance: dict | None = None) -> tvm.IRModule:
    return fusion_pipeline(fusion, provenance)(mod)
