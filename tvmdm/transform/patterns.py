"""The paper's pattern kernels (substation's): SM, the attention context, BDRLN, and the passes around
``FuseOpsByPattern`` that name them, record what share of a packed input each reads, and inline their
element-wise blocks. A training step adds its backward kernels' patterns (tvmdm.train.fusion)."""
from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.dpl import is_const, is_op, is_tuple, wildcard
from tvm.s_tir import schedule as sch_mod

from tvmdm.transform.ir import call_op, op_name

FORWARD_KERNELS = ("sm", "attention_context", "bdrln")


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


def inline_pattern_kernels(names) -> tvm.transform.Pass:
    """TIR side of the pattern fusion: inline the element-wise blocks of the pattern kernels ``names`` (sm,
    attention_context, bdrln and, in a training step, the backward ones), so compile, our default schedules
    and the tuner all see the fused form."""
    names = frozenset(names)

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.InlinePatternKernels")
    def run(mod, _ctx):
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and op_name(gv.name_hint) in names:
                out[gv] = _inline_producers(func)
        return out

    return run


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


def paper_patterns(extra=(), batched_attention: bool = False) -> list[tuple]:
    """(name, dataflow pattern, annotations, check) of the kernels the paper fuses beyond stock FuseOps,
    most specific first; ``extra``: (kernel name, pattern) pairs matched after them (a training step's
    backward kernels). ``batched_attention`` (on matrix units: CUDA's tensor cores, AMX): the attention's
    contractions stay kernels of their own (one contraction a kernel): the scores' scale and mask fuse into
    the scores kernel's epilogue and the softmax is a row kernel; only BDRLN is fused."""
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
    if batched_attention:
        forward = [(bdrln_name, bdrln)]
    extra = [(f"tvmdm.{name}", pattern) for name, pattern in extra]
    return [(name, pattern, {}, _intermediates_stay_inside) for name, pattern in forward + extra]


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
            if call_op(expr) != "relax.strided_slice" or i != 0 or len(expr.args[1]) != 1:
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
