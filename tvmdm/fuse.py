"""Fusion: Relax graph -> fused TIR kernels.

Levels (``fusion=`` in compile):
  "none"  - every operator its own kernel (the unfused baseline the paper measures against),
  "tvm"   - TVM's stock FuseOps/FuseTIR,
  "paper" - the paper's rules (substation's kernels) before stock fusion takes the rest: one merged QKV
            contraction (AIB: its biases ride in its epilogue), transposes folded into the attention
            contractions (layouts: see graph_rewrites), SM (scores contraction + 1/sqrt(d) scale + mask +
            softmax in one kernel), the context contraction reading V in place, BDRLN (bias + residual +
            LayerNorm after the output contractions, twice) and BGD (contraction + bias + GELU, stock
            FuseOps' epilogue); in a training step also its backward kernels BLNRD, BSB and BS
            (tvmdm.backward_kernels).
Each level is a ``tvm.transform.Sequential`` of Relax passes (IRModule -> IRModule). Inside the paper's
kernels the element-wise blocks are inlined by a TIR pass (inline_pattern_kernels); inside the others by the
schedules (ours and MetaSchedule's AutoInline), so the intermediates of a group never reach memory as tensors.
"""
from __future__ import annotations

import re

import tvm
from tvm import relax, tirx

from tvm.relax.dpl import is_const, is_op, is_tuple, wildcard
from tvm.s_tir import schedule as sch_mod

from tvmdm import compat, graph_rewrites
from tvmdm.backward import transposed_left_contractions
from tvmdm.backward_kernels import BACKWARD_KERNELS, backward_patterns, recompute_gelu_gradient
from tvmdm.precision import precision_passes

FUSION_LEVELS = ("none", "tvm", "paper")
DEFAULT_FUSION = "paper"  # of compile, compile_train_step, the CLI, bench and the tuner
# Attention layouts (graph_rewrites.absorb_transposes): "bshd" reads Q/K/V and writes the context where the
# projections want them (no transposes); "bhsd" makes head-major copies (the ONNX graph's transposes);
# "qkv=bshd,ctx=bhsd" and the like mix them, per tensor group, as the layout search may choose.
LAYOUTS = ("bshd", "bhsd", "qkv=bshd,ctx=bhsd", "qkv=bhsd,ctx=bshd")


def parse_layout(layout: str) -> dict[str, str]:
    """"bshd" -> {"qkv": "bshd", "ctx": "bshd"}; "qkv=bshd,ctx=bhsd" -> {"qkv": "bshd", "ctx": "bhsd"}."""
    if "=" not in layout:
        parts = {"qkv": layout, "ctx": layout}
    else:
        try:
            parts = dict(item.split("=", 1) for item in layout.split(","))
        except ValueError:
            parts = {}
    if set(parts) != {"qkv", "ctx"} or not set(parts.values()) <= set(graph_rewrites.ATTENTION_LAYOUTS):
        raise ValueError(f"unknown attention layout {layout!r}; choose one of {list(LAYOUTS)}")
    return parts


def layout_name(qkv: str, ctx: str) -> str:
    return qkv if qkv == ctx else f"qkv={qkv},ctx={ctx}"


def lowering_passes() -> list:
    """Graph ops -> TIR PrimFuncs, with op patterns annotated for fusion.

    FastMathTransform swaps erf, exp and softmax for TVM's polynomial versions (fast_erf is within 4.2e-7
    of float64 erf over [-6, 6], measured): exact erf costs as much as the FFN contraction it is fused with."""
    return [
        compat.fast_math(),
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


def _attention_operand():
    """An attention contraction's operand: Q, K or V sliced in place out of the packed QKV output (merge_qkv),
    or any tensor."""
    sliced = is_op("relax.strided_slice")(wildcard(), varg_default_wildcard=True)
    return is_op("relax.squeeze")(sliced) | wildcard()


CHEAP_BLOCK_CHARS = 1000  # printed size of a block body: an add or a slice ~450, fast_exp's polynomial ~3500


def _inline_producers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Inline every element-wise producer block into its consumers when it has one consumer or is cheap to
    recompute (a bias add read by LayerNorm's two reductions and its normalization): the pattern kernel's
    intermediates then never exist as buffers. Expensive blocks read twice (softmax's exp) stay."""
    sch = sch_mod.Schedule(func)
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            node = sch.get(block)
            consumers = sch.get_consumers(block)
            if not consumers or any(iv.iter_type != tirx.IterVar.DataPar for iv in node.iter_vars):
                continue
            if len(consumers) > 1 and len(node.body.script()) > CHEAP_BLOCK_CHARS:
                continue
            try:
                sch.compute_inline(block)
            except sch_mod.ScheduleError:
                continue
            changed = True
            break
    return sch.mod["main"]


def inline_pattern_kernels() -> tvm.transform.Pass:
    """TIR side of the pattern fusion: inline the element-wise blocks of the paper's kernels (sm,
    attention_context, bdrln and the backward ones), so compile, our default schedules and the tuner all see
    the fused form."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.InlinePatternKernels")
    def run(mod, _ctx):
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and op_name(gv.name_hint) in PAPER_KERNELS:
                out[gv] = _inline_producers(func)
        return out

    return run


FORWARD_KERNELS = ("sm", "attention_context", "bdrln")
PAPER_KERNELS = FORWARD_KERNELS + BACKWARD_KERNELS  # the pattern kernels, by the names they get


def _sm_pattern(operand):
    """SM: scores contraction (einsum or matmul of two ``operand()``s) [* or / a constant scale] [+ mask],
    softmax [, its NaNs replaced by a constant]. ``operand`` makes one operand pattern per use: a pattern
    object used twice must match the same expression twice."""
    scores = (is_op("relax.einsum")(is_tuple([operand(), operand()]))
              | is_op("relax.matmul")(operand(), operand()))
    scaled = is_op("relax.multiply")(scores, is_const()) | is_op("relax.divide")(scores, is_const()) | scores
    masked = is_op("relax.add")(scaled, wildcard()) | scaled
    probs = is_op("relax.nn.softmax")(masked)
    # torch's export of scaled_dot_product_attention zeroes the NaNs of fully masked rows after the softmax
    return is_op("relax.where")(is_op("relax.isnan")(probs), is_const(), probs) | probs


def paper_patterns() -> list[tuple]:
    """(name, dataflow pattern, annotations, check) of the kernels the paper fuses beyond stock FuseOps,
    most specific first."""
    context = is_op("relax.einsum")(is_tuple([wildcard(), _attention_operand()]))
    # BDRLN as substation has it: the contraction stays a kernel of its own (MetaSchedule 0.27 cannot tile a
    # contraction whose epilogue is a LayerNorm: its design space raises in reverse_compute_at).
    biased = is_op("relax.add")(wildcard(), wildcard())
    residual = is_op("relax.add")(biased, wildcard())
    bdrln = is_op("relax.nn.layer_norm")(residual, wildcard(), wildcard())
    sm, attention_context, bdrln_name = (f"tvmdm.{k}" for k in FORWARD_KERNELS)
    # The second SM has plain operands: where the backward pass reads Q, K or V (a training step), the
    # slices must stay their own values and only the contraction onwards fuses.
    forward = [(sm, _sm_pattern(_attention_operand)), (attention_context, context), (bdrln_name, bdrln),
               (sm, _sm_pattern(wildcard))]
    backward = [(f"tvmdm.{name}", pattern) for name, pattern in backward_patterns()]  # match in training steps
    return [(name, pattern, {}, _intermediates_stay_inside) for name, pattern in forward + backward]


def _intermediates_stay_inside(ctx) -> bool:
    """Fuse a match only when no value computed inside it is read outside (a training step's backward pass
    reads the forward's intermediates; fusing those away would leave the reader without its input)."""
    root = ctx.value_to_bound_var.get(ctx.matched_expr)
    inside = set(ctx.matched_bindings.keys())
    for var in inside:
        if var.same_as(root):
            continue
        if any(user not in inside for user in ctx.var_usages.get(var, [])):
            return False
    return True


def name_paper_kernels() -> tvm.transform.Pass:
    """Name each pattern-fused function after its paper kernel ("sm", "bdrln", "bdrln1", ...): FuseTIR names
    the kernel after it, so reports, profiles and tuning logs say which kernel is which."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.NamePaperKernels")
    def run(mod, _ctx):
        taken = {gv.name_hint for gv in mod.get_global_vars()}
        renames = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and func.attrs is not None and "Composite" in func.attrs:
                base = str(func.attrs["Composite"]).split(".")[-1]
                name, n = base, 0
                while name in taken:
                    n += 1
                    name = f"{base}{n}"
                taken.add(name)
                renames[gv] = name
        if not renames:
            return mod
        # Every function gets its GlobalVar from the new builder (PrimFuncs too: main's calls must point at
        # the module's own GlobalVars), then the Relax functions' references are remapped.
        bb = relax.BlockBuilder()
        new_gvs = {gv: bb.add_func(func, renames.get(gv, gv.name_hint)) for gv, func in mod.functions_items()}

        @relax.expr_functor.mutator
        class Rename(relax.PyExprMutator):
            def visit_global_var_(self, gv):
                return new_gvs.get(gv, gv)

        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                bb.update_func(new_gvs[gv], Rename().visit_expr(func))
        return bb.get()

    return run


def _slice_hull(func: relax.Function, param) -> float | None:
    """Fraction of ``param`` that ``func`` reads, when it only reads strided_slices of it along one axis."""
    spans, axes = [], set()
    only_sliced = True

    def visit(expr):
        nonlocal only_sliced
        if not isinstance(expr, relax.Call):
            return
        for i, arg in enumerate(expr.args):
            if not arg.same_as(param):
                continue
            if graph_rewrites.call_op(expr) != "relax.strided_slice" or i != 0 or len(expr.args[1]) != 1:
                only_sliced = False
                return
            axes.add(int(expr.args[1][0]))
            spans.append((int(expr.args[2][0]), int(expr.args[3][0])))

    relax.analysis.post_order_visit(func.body, visit)
    if not only_sliced or len(axes) != 1 or not spans:
        return None
    extent = int(param.ty.shape.values[axes.pop()])
    return (max(e for _, e in spans) - min(b for b, _ in spans)) / extent


def record_read_fractions(fractions: dict) -> tvm.transform.Pass:
    """Analysis pass: ``fractions[kernel][i]`` = share of input i the kernel reads, for inputs it only reads
    slices of (the attention kernels read Q, K or V out of the packed QKV tensor): the data-movement report
    counts those bytes, not the whole packed tensor."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.RecordReadFractions")
    def run(mod, _ctx):
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and func.attrs is not None and "Composite" in func.attrs:
                shares = {i: f for i, p in enumerate(func.params) if (f := _slice_hull(func, p)) is not None}
                if shares:
                    fractions[gv.name_hint] = shares
        return mod

    return run


def paper_graph_rewrites(layout: str = "bshd") -> tvm.transform.Pass:
    """The graph rewrites of the "paper" level (on ``main``; a training step applies them before Gradient,
    so the backward graph inherits the merged QKV and the transpose-free attention)."""
    # The contractions keep the operand order ONNX gave their bias adds, so kernels the paper's rules leave
    # alone (the FFN's matmul + bias + GELU) are the very kernels stock fusion makes: their tuned records apply.
    return tvm.transform.Sequential([graph_rewrites.merge_qkv(), graph_rewrites.hoist_operand_scales(),
                                     graph_rewrites.drop_noop_reshapes(),
                                     graph_rewrites.absorb_transposes(**parse_layout(layout))],
                                    name="tvmdm.PaperGraphRewrites")


def graph_passes(fusion: str, layout: str = "bshd", read_fractions: dict | None = None, lift_params: bool = True,
                 precision: str = "fp32", target_kind: str = "llvm", packed_lanes: int | None = None) -> list:
    """Graph-level passes before lowering: the paper's rewrites, the precision rewrite (bf16 contractions see the
    merged QKV), weight-only work lifted to main_transform_params, then the paper's pattern fusion.
    ``lift_params``: lift (inference only: a training step changes its weights every step). ``packed_lanes``:
    fp32 weights packed in panels that wide (see precision.packed_fp32_contractions)."""
    passes = [paper_graph_rewrites(layout)] if fusion == "paper" else []
    if fusion == "paper" and not lift_params:  # a training step: its GELU gradient from the pre-activation alone
        passes.append(recompute_gelu_gradient())
    passes += precision_passes(precision, training=not lift_params, target_kind=target_kind,
                               packed_lanes=packed_lanes)
    if not lift_params:  # a training step: its weight gradients read the activations transposed, in place
        passes.append(transposed_left_contractions())
    if lift_params and (fusion == "paper" or precision != "fp32" or packed_lanes):
        passes.append(relax.transform.LiftTransformParams())
    if fusion == "paper":
        passes += [relax.transform.FuseOpsByPattern(paper_patterns(), bind_constants=False, annotate_codegen=False),
                   name_paper_kernels(), record_read_fractions({} if read_fractions is None else read_fractions)]
    return passes


def fusion_pipeline(fusion: str = "tvm", provenance: dict | None = None, layout: str = "bshd",
                    read_fractions: dict | None = None, lift_params: bool = True,
                    precision: str = "fp32", target_kind: str = "llvm",
                    packed_lanes: int | None = None) -> tvm.transform.Pass:
    """The Sequential pass for a fusion level; ``provenance`` (a dict) receives kernel -> ops,
    ``read_fractions`` kernel -> {input index: share of it read} (see record_read_fractions)."""
    if fusion not in FUSION_LEVELS:
        raise ValueError(f"unknown fusion level {fusion!r}; choose one of {list(FUSION_LEVELS)}")
    provenance = {} if provenance is None else provenance
    passes = graph_passes(fusion, layout, read_fractions, lift_params, precision, target_kind,
                          packed_lanes) + lowering_passes()
    if fusion in ("tvm", "paper"):
        passes += [relax.transform.FuseOps(), record_kernel_ops(provenance), relax.transform.FuseTIR()]
        if fusion == "paper":
            passes.append(inline_pattern_kernels())
    else:
        passes.append(record_kernel_ops(provenance))
    # A kernel that only reshapes becomes a view (as relax.build would do): no bytes move.
    passes += [relax.transform.RewriteDataflowReshape(), relax.transform.DeadCodeElimination()]
    return tvm.transform.Sequential(passes, name=f"tvmdm.fuse.{fusion}")


def fuse(mod: tvm.IRModule, fusion: str = "tvm", provenance: dict | None = None, layout: str = "bshd",
         read_fractions: dict | None = None, lift_params: bool = True, precision: str = "fp32",
         target_kind: str = "llvm", packed_lanes: int | None = None) -> tvm.IRModule:
    return fusion_pipeline(fusion, provenance, layout, read_fractions, lift_params, precision, target_kind,
                           packed_lanes)(mod)
