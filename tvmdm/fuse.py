"""Fusion: Relax graph -> fused TIR kernels.

Levels (``fusion=`` in compile):
  "none" - every operator its own kernel (the unfused baseline the paper measures against),
  "tvm"  - TVM's stock FuseOps/FuseTIR.
Each level is a ``tvm.transform.Sequential`` of Relax passes (IRModule -> IRModule).
"""
from __future__ import annotations

import tvm
from tvm import relax

FUSION_LEVELS = ("none", "tvm")


def lowering_passes() -> list:
    """Graph ops -> TIR PrimFuncs, with op patterns annotated for fusion."""
    return [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
    ]


def fusion_pipeline(fusion: str = "tvm") -> tvm.transform.Pass:
    """The Sequential pass for a fusion level."""
    if fusion not in FUSION_LEVELS:
        raise ValueError(f"unknown fusion level {fusion!r}; choose one of {list(FUSION_LEVELS)}")
    passes = lowering_passes()
    if fusion == "tvm":
        passes += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
    passes.append(relax.transform.DeadCodeElimination())
    return tvm.transform.Sequential(passes, name=f"tvmdm.fuse.{fusion}")


def fuse(mod: tvm.IRModule, fusion: str = "tvm") -> tvm.IRModule:
    return fusion_pipeline(fusion)(mod)
