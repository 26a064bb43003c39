"""Default schedules for kernels that have no tuned record.

CUDA: dlight's GPU rules (every kernel needs thread bindings to run at all on a GPU).
CPU: dlight.cpu only knows GEMV and reductions, so every other kernel would keep LegalizeOps' serial loop nest
(16 s for a BERT-base layer). Our rule: fuse the leading spatial loops of each block, run them in parallel over
the cores, and vectorize an innermost spatial loop when the block has no reduction. Tuned logs beat it by far;
it only keeps untuned kernels from being serial.
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir import schedule as sch_mod
from tvm.s_tir.analysis import estimate_tir_flops

from schedules.intrinsics_import import import_cuda_intrinsics
from schedules.rule import FLOPS_ATTR, ScheduleRule
from schedules.tensor_cores import TensorCoreContractions

VECTOR_LANES = 16  # 512-bit vectors of fp32


def divides(extent, factor: int) -> bool:
    """Whether ``factor`` divides ``extent`` for sure: a concrete one, or a symbolic one written as a multiple
    of it (tvmdm.transform.attention_padding's blocks * 16)."""
    if isinstance(extent, tirx.IntImm):
        return int(extent) % factor == 0
    return bool(tvm.sym.Analyzer().can_prove(tirx.floormod(extent, factor) == 0))


def tile_dividing(extent, tiles) -> int:
    """The first of ``tiles`` (largest first, the last 1) that divides ``extent`` (see divides); the last for
    another symbolic one (a module serving every batch and seq): a partial tile would need a predicate, which
    made the tile's local buffers of symbolic size (heap, not registers) and broke rfactor's vectorized
    partials."""
    return next((t for t in tiles if divides(extent, t)), tiles[-1])


def splits_evenly(extent, factor: int) -> bool:
    """Whether a loop of ``extent`` splits into whole ``factor``-long pieces, a symbolic extent taken as yes: its
    partial last piece is guarded by the split's predicate (for loops whose blocks keep no local buffer per
    piece; see tile_dividing)."""
    return not isinstance(extent, tirx.IntImm) or int(extent) % factor == 0


def gpu_rules() -> list:
    """Tried in order, the first that applies wins: our tensor-core contractions, then dlight's rules."""
    return [TensorCoreContractions(), dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback()]


def _vectorize_inner(sch, loop) -> None:
    extent = sch.get(loop).extent
    if isinstance(extent, tirx.IntImm) and extent.value % VECTOR_LANES == 0 and extent.value >= VECTOR_LANES:
        _, lanes = sch.split(loop, [None, VECTOR_LANES])
        sch.vectorize(lanes)


def _schedule_block(sch, block) -> None:
    """LegalizeOps writes one loop per iter var, spatial ones first, in iter-var order."""
    loops = sch.get_loops(block)
    if not loops or any(sch.get(loop).kind != tirx.ForKind.SERIAL for loop in loops):
        return
    iter_types = [iv.iter_type for iv in sch.get(block).iter_vars]
    n_spatial = sum(1 for t in iter_types if t == tirx.IterVar.DataPar)
    if len(loops) != len(iter_types) or n_spatial == 0:
        return
    spatial, reductions = list(loops[:n_spatial]), list(loops[n_spatial:])
    if not reductions:
        # Element-wise: parallel over all but the innermost dim, vector lanes along it.
        inner = spatial.pop() if len(spatial) >= 2 else None
        sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])
        if inner is not None:
            _vectorize_inner(sch, inner)
        return
    # Reduction (matmul, softmax statistics, LayerNorm): move the innermost spatial loop inside the
    # reduction so consecutive outputs accumulate side by side (LLVM vectorizes that contiguous loop; the
    # vectorize primitive refuses a loop under which the reduction is not complete), parallel over the
    # outer spatial dims.
    inner = spatial.pop() if len(spatial) >= 2 else None
    if inner is not None:
        sch.reorder(*spatial, *reductions, inner)
    sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])
    if inner is not None:
        init = sch.decompose_reduction(block, reductions[0])
        _vectorize_inner(sch, sch.get_loops(init)[-1])


def inline_elementwise(sch, root) -> list[str]:
    """Inline every block but the last into its consumers where it is element-wise (fewer blocks, fewer passes
    over memory); returns the names of the blocks left, in order."""
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(root)]
    for name in list(names[:-1]):
        try:
            sch.compute_inline(sch.get_sblock(name))
            names.remove(name)
        except Exception:  # noqa: BLE001 - not inlinable (a reduction, several consumers): keep the block
            pass
    return names


def cpu_default_schedule(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Parallel (and where possible vectorized) version of an unscheduled LegalizeOps kernel."""
    sch = sch_mod.Schedule(func)
    try:
        root = sch.get_sblock("root")
    except sch_mod.ScheduleError:  # hand-written kernels (e.g. take's gradient, a te.extern) have no block tree
        return func.with_attr("tirx.is_scheduled", True)
    for name in inline_elementwise(sch, root):
        state = sch.mod
        try:
            _schedule_block(sch, sch.get_sblock(name))
        except Exception:  # noqa: BLE001 - a loop nest the rule does not fit stays as LegalizeOps wrote it
            sch = sch_mod.Schedule(state)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def apply_default_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Schedule every kernel that is not scheduled yet."""
    if target.kind.name == "cuda":
        return apply_gpu_rules(mod, target)
    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and not (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
            out[gv] = cpu_default_schedule(func.with_attr("global_symbol", gv.name_hint))
    for gv, func in out.items():
        mod[gv] = func
    return mod


def apply_gpu_rules(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """dlight's rules, first that applies wins, as ``dl.ApplyDefaultSchedule`` does, except that a rule which
    crashes on a kernel (0.27's reduction rules do on some backward kernels: "block_realize ==
    old_block_realize_") is skipped for that kernel instead of failing the whole build."""
    import_cuda_intrinsics()  # before the Matmul rule imports them, ~24 s slower (schedules.intrinsics_import)
    out = {}
    with target:
        for gv, func in mod.functions.items():
            if not isinstance(func, tirx.PrimFunc) or (func.attrs and func.attrs.get("tirx.is_scheduled", False)):
                continue
            for rule in gpu_rules():
                try:
                    space = rule.apply(func, target, False)
                except Exception:  # noqa: BLE001 - the next rule (Fallback last) takes the kernel
                    continue
                if space is not None:
                    sch = space[0] if isinstance(space, list) else space
                    # counted before tensorization hides the arithmetic in intrinsic calls (analyze reads it)
                    flops = int(estimate_tir_flops(tvm.IRModule({"main": func})))
                    out[gv] = sch.mod["main"].with_attrs({"tirx.is_scheduled": True, FLOPS_ATTR: flops})
                    break
    for gv, func in out.items():
        mod[gv] = func
    return mod


class DefaultSchedule(ScheduleRule):
    """The last rule: every kernel no other rule took (CPU: parallel + vectorized loops; CUDA: dlight's rules)."""

    name = "default"
    hand_written = False

    def apply(self, kernels: dict, options) -> dict:
        mod = apply_default_schedules(tvm.IRModule(kernels), options.target)
        ours = {gv.name_hint: gv for gv in kernels}
        return {ours[gv.name_hint]: f for gv, f in mod.functions.items() if gv.name_hint in ours}
