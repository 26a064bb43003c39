"""Fusion: Relax graph -> fused TIR kernels.

Levels (``Options.fusion``):
  "none"  - every operator its own kernel (the unfused baseline the paper measures against),
  "tvm"   - TVM's stock FuseOps/FuseTIR,
  "paper" - the paper's rules (substation's kernels) before stock fusion takes the rest: one merged QKV
            contraction (AIB: its biases ride in its epilogue), transposes folded into the attention
            contractions (layouts: see graph_rewrites), SM (scores contraction + 1/sqrt(d) scale + mask +
            softmax in one kernel), the context contraction reading V in place, BDRLN (bias + residual +
            LayerNorm after the output contractions, twice) and BGD (contraction + bias + GELU, stock
            FuseOps' epilogue); in a training step also its backward kernels (``TrainingFusion``, made by
            tvmdm.train.fusion: this stage knows nothing of training graphs).
Each level is a ``tvm.transform.Sequential`` of Relax passes (IRModule -> IRModule). Inside the paper's
kernels the element-wise blocks are inlined by a TIR pass (patterns.inline_pattern_kernels); inside the
others by the schedules (ours and MetaSchedule's AutoInline), so the intermediates of a group never reach
memory as tensors.
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax, tirx

from tvmdm.core.options import Options
from tvmdm.core.target import attention_on_matrix_units, has_amx_int8, has_avx_vnni, has_int8_dot
from tvmdm.transform.constant_divisors import divide_by_reciprocal
from tvmdm.transform.fast_math import fast_math
from tvmdm.transform.isnan_bits import isnan_as_bits
from tvmdm.transform.graph_rewrites import paper_graph_rewrites
from tvmdm.transform.index_guards import guard_gathers
from tvmdm.transform.ir import has_symbolic_inputs, op_name
from tvmdm.transform.patterns import (FORWARD_KERNELS, inline_pattern_kernels, name_paper_kernels, paper_patterns,
                                      record_read_fractions)
from tvmdm.transform.precision import precision_passes
from tvmdm.transform.attention_padding import pad_attention_keys, whole_block_kernels
from tvmdm.transform.quantized import int8_contractions
from tvmdm.transform.tile_attention import tile_attention
from tvmdm.transform.row_reductions import rows_then_whole
from tvmdm.transform.stats_into_producers import stats_into_producers
from tvmdm.transform.attention_kernel import ATTENTION_KERNEL, attention_kernel


@dataclasses.dataclass(frozen=True)
class TrainingFusion:
    """What a training step adds to fusion: graph passes before and after the precision rewrite, and the
    (kernel name, pattern) pairs of its backward kernels."""

    before_precision: tuple = ()
    after_precision: tuple = ()
    patterns: tuple = ()


@dataclasses.dataclass
class FusionRecord:
    """What fusion found out on the way, for reports: kernel -> the graph ops it covers; kernel -> {input
    index: share of it read} for packed inputs a kernel reads only a slice of (patterns.record_read_fractions)."""

    kernel_ops: dict = dataclasses.field(default_factory=dict)
    read_fractions: dict = dataclasses.field(default_factory=dict)


def lowering_passes() -> list:
    """Graph ops -> TIR PrimFuncs, with op patterns annotated for fusion.

    FastMathTransform swaps erf, exp and softmax for TVM's polynomial versions (fast_erf is within 4.2e-7
    of float64 erf over [-6, 6], measured): exact erf costs as much as the FFN contraction it is fused with.
    Divisions by a constant that only those read become multiplies by its reciprocal (GELU's x / sqrt(2));
    isnan becomes a test of the bits, which TVM vectorizes (its own isnan made the loop scalar)."""
    return [
        divide_by_reciprocal(),
        isnan_as_bits(),
        fast_math(),
        relax.transform.DecomposeOpsForInference(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
    ]


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


def graph_passes(options: Options, record: FusionRecord, training: TrainingFusion) -> list:
    """Graph-level passes before lowering: the paper's rewrites, the precision rewrite (bf16 contractions see the
    merged QKV), weight-only work lifted to main_transform_params (inference only: a training step changes its
    weights every step), then the paper's pattern fusion."""
    paper = options.fusion == "paper"
    # inference: gathers clipped into their tables and checked in the module (a training graph clips its indices
    # before its gradient: tvmdm.train.step)
    passes = [guard_gathers()] if not options.training else []
    # quantized models: integer matmuls (CPUs), DynamicQuantizeLinear's max / min in parallel (nothing to do in
    # other models)
    passes += [int8_contractions(vnni=has_int8_dot(options.target), avx_vnni=has_avx_vnni(options.target),
                                 tiles=has_amx_int8(options.target))] \
        if options.on_cpu else []
    passes.append(rows_then_whole())
    passes += [paper_graph_rewrites(options.layout, options.batched_attention)] if paper else []
    passes += list(training.before_precision)
    passes += precision_passes(options.precision, training=options.training, target_kind=options.target_kind,
                               packed_lanes=options.packed_lanes)
    passes += list(training.after_precision)
    if not options.training and (paper or options.precision != "fp32" or options.packed_lanes):
        passes.append(relax.transform.LiftTransformParams())
    if paper:
        passes += [relax.transform.FuseOpsByPattern(paper_patterns(training.patterns, options.batched_attention),
                                                    bind_constants=False,
                                                    annotate_codegen=False),
                   name_paper_kernels(), record_read_fractions(record.read_fractions)]
        if options.on_cpu and not options.training and not options.batched_attention:
            if attention_on_matrix_units(options.target, options.precision):
                passes.append(tile_attention())  # the attention in one tile kernel, scores to context
            passes.append(pad_attention_keys())  # symbolic sequences: whole vectors of keys
    return passes


def fusion_pipeline(options: Options, record: FusionRecord | None = None,
                    training: TrainingFusion | None = None) -> tvm.transform.Pass:
    """The Sequential pass for ``options.fusion``; ``record`` (a FusionRecord) receives what it finds.
    ``training``: a training step's additions (required when ``options.training``)."""
    if options.training and training is None:
        raise ValueError("a training step's fusion needs its TrainingFusion (tvmdm.train.fusion.training_fusion)")
    training = training or TrainingFusion()
    record = FusionRecord() if record is None else record
    passes = graph_passes(options, record, training) + lowering_passes()
    if options.fusion in ("tvm", "paper"):
        passes += [relax.transform.FuseOps(), record_kernel_ops(record.kernel_ops), relax.transform.FuseTIR()]
        if options.fusion == "paper":
            passes.append(inline_pattern_kernels(FORWARD_KERNELS + tuple(name for name, _ in training.patterns)))
            if options.on_cpu and not options.training:
                passes.append(attention_kernel(record.kernel_ops))  # SM's probabilities kept in cache
            passes.append(whole_block_kernels())
        if options.on_cpu:  # quantized models: DynamicQuantizeLinear's max / min by the activation's producer
            passes.append(stats_into_producers(record.kernel_ops))
    else:
        passes.append(record_kernel_ops(record.kernel_ops))
    # A kernel that only reshapes becomes a view (as relax.build would do): no bytes move.
    passes += [relax.transform.RewriteDataflowReshape(), relax.transform.DeadCodeElimination()]
    return tvm.transform.Sequential(passes, name=f"tvmdm.fuse.{options.fusion}")


def fuse(mod: tvm.IRModule, options: Options,
         training: TrainingFusion | None = None) -> tuple[tvm.IRModule, FusionRecord]:
    """``mod`` fused as ``options`` say, and what fusion recorded. CPU inference on tile units runs each
    attention as one tile kernel; where that kernel takes none of them (heads not whole tiles: the fp32 SM is
    left), a static module keeps them as batched matmuls on the dot products instead, as a training step does
    (symbolic ones keep the fp32 SM, the faster of the two there)."""
    record = FusionRecord()
    fused = fusion_pipeline(options, record, training)(mod)
    if _attention_left_off_tiles(fused, options) and not has_symbolic_inputs(mod):
        record = FusionRecord()
        fused = fusion_pipeline(dataclasses.replace(options, batched_attention=True), record, training)(mod)
    return fused, record


def _attention_left_off_tiles(fused: tvm.IRModule, options: Options) -> bool:
    return options.on_cpu and not options.training and not options.batched_attention \
        and attention_on_matrix_units(options.target, options.precision) \
        and any(op_name(gv.name_hint) in ("sm", ATTENTION_KERNEL) for gv, f in fused.functions_items()
                if isinstance(f, tirx.PrimFunc))

