"""Graph rewrites of the paper's fusion level, each a Relax module pass (IRModule -> IRModule) on ``main``.

They run on the imported graph, before LegalizeOps:
  merge_qkv             - the Q, K and V projections (matmuls reading the same activations, each plus its
                          bias) become one contraction with packed [H, 3H] weights (X is read once, not three
                          times); each old projection is a slice of the packed output, which the attention
                          kernels read in place once fused (the concat of the weights only depends on weights:
                          LiftTransformParams moves it to ``main_transform_params``, run once at load).
  fold_reshaped_transposes - reshape / transpose / reshape chains that only permute axes (dynamo's K^T)
                          become one permute_dims (tvmdm.transform.reshaped_transposes).
  hoist_operand_scales  - a scale on each operand of the scores contraction (how torch exports
                          scaled_dot_product_attention) becomes one scale of its output.
  drop_noop_reshapes    - reshapes to the shape a tensor already has are dropped.
  absorb_transposes     - the attention's permute_dims around its batched contractions are folded into the
                          contractions (einsum with permuted subscripts): Q, K, V and the context are read and
                          written in the projections' [B, S, h, d] layout, and no transpose kernel is left.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from tvmdm.core.options import ATTENTION_LAYOUTS, DEFAULT_LAYOUT, parse_layout
from tvmdm.transform.ir import bindings_of, call_op, main_pass, permutation, rank, scalar_constant, users_of
from tvmdm.transform.reshaped_transposes import fold_reshaped_transposes


# --- merged QKV projection ------------------------------------------------------------------------------


def _projection_groups(func: relax.Function, users: dict) -> list[list[tuple]]:
    """Groups of >= 2 projections reading the same activations: [(matmul var, bias add var, W, b), ...].
    A projection is matmul(x, W) with W a 2-D weight parameter, read only by an add of it and b (either
    order: ONNX exporters write Add(bias, MatMul)) with b a 1-D weight parameter of W's output size."""
    weights = set(func.params)
    adds = {}
    for block in func.body.blocks:
        for b in block.bindings:
            if call_op(b.value) == "relax.add":
                for i, arg in enumerate(b.value.args):
                    if isinstance(arg, relax.Var):
                        adds.setdefault(arg, []).append((b, b.value.args[1 - i]))
    groups: dict = {}
    for block in func.body.blocks:
        for b in block.bindings:
            if call_op(b.value) != "relax.matmul":
                continue
            x, w = b.value.args
            if w not in weights or rank(w) != 2 or users.get(b.var, 0) != 1 or len(adds.get(b.var, [])) != 1:
                continue
            add, bias = adds[b.var][0]
            if bias not in weights or rank(bias) != 1 or \
                    int(bias.ty.shape.values[0]) != int(w.ty.shape.values[1]):
                continue
            groups.setdefault(x, []).append((b.var, add.var, w, bias))
    return [g for g in groups.values() if len(g) >= 2]


def _head_split(values: dict, users: dict, group: list[tuple]) -> tuple | None:
    """(reshape vars, heads, head_dim) when every projection's only reader is a reshape to [..., h, d] (the
    attention's head split), else None."""
    outputs = {add for _, add, _, _ in group}
    readers = {}
    for var, value in values.items():
        if call_op(value) == "relax.reshape" and value.args[0] in outputs:
            readers[value.args[0]] = var
    if len(readers) != len(group) or any(users.get(add, 0) != 1 for _, add, _, _ in group):
        return None
    shapes = {tuple(int(d) for d in var.ty.shape.values[-2:]) for var in readers.values()}
    if len(shapes) != 1:
        return None
    heads, head_dim = shapes.pop()
    return [readers[add] for _, add, _, _ in group], heads, head_dim


def merge_qkv() -> tvm.transform.Pass:
    """Projections of the same activations (Q, K, V) -> one matmul with concatenated weights and biases.
    When each projection is split into heads, the packed output is viewed as [..., 3, h, d] and each head-split
    projection is a slice of it along the "3" axis (q = packed[..., 0, :, :]); otherwise a slice of the last
    axis. Either way the attention kernels read the slices in place once fused."""

    @main_pass("MergeQKV")
    def rewrite(mod, func):
        values, users = bindings_of(func), users_of(func)
        groups = _projection_groups(func, users)
        if not groups:
            return None
        splits = {id(g): _head_split(values, users, g) for g in groups}
        first = {g[0][0]: g for g in groups}  # merged matmul is emitted where the first projection was
        dropped = {var for g in groups for mm, add, _, _ in g for var in (mm, add)}
        dropped |= {r for s in splits.values() if s for r in s[0]}

        @relax.expr_functor.mutator
        class Merge(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                group = first.get(binding.var)
                if group is not None:
                    self._emit_merged(binding.value.args[0], group, splits[id(group)])
                    return None
                if binding.var in dropped:
                    return None
                return super().visit_var_binding_(binding)

            def _emit_merged(self, x, group, split):
                bb = self.builder_
                w = bb.emit(relax.op.concat([w for _, _, w, _ in group], axis=1))
                b = bb.emit(relax.op.concat([b for _, _, _, b in group], axis=0))
                y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(self.visit_expr(x), w)), b))
                lead = list(y.ty.shape.values[:-1])
                if split is not None:
                    reshapes, heads, head_dim = split
                    packed = bb.emit(relax.op.reshape(y, lead + [len(group), heads, head_dim]))
                    axis = len(lead)
                    for i, var in enumerate(reshapes):
                        part = relax.op.strided_slice(packed, axes=[axis], begin=[i], end=[i + 1])
                        self.set_var_remap(var, bb.emit(relax.op.squeeze(bb.emit(part), axis=[axis])))
                    return
                offset = 0
                for _, add, w_i, _ in group:
                    width = int(w_i.ty.shape.values[1])
                    part = relax.op.strided_slice(y, axes=[len(lead)], begin=[offset], end=[offset + width])
                    self.set_var_remap(add, bb.emit(part))
                    offset += width

        return Merge(mod).visit_expr(func).body

    return rewrite


# --- scales on both operands of the scores contraction (scaled_dot_product_attention as exported) -----------


def _scalar_constant(expr) -> float | None:
    """The value of a one-element float constant, else None."""
    value = scalar_constant(expr)
    return float(value) if value is not None and value.dtype.kind == "f" else None


def hoist_operand_scales() -> tvm.transform.Pass:
    """matmul(a * c1, b * c2) (4-D, constants c1 and c2 each one element, the products read by nothing else)
    -> matmul(a, b) * (c1 c2). torch exports scaled_dot_product_attention so (q and k each scaled by
    sqrt(1/sqrt(d))): left alone, each scale is a pass over Q or K of its own and keeps their transposes out
    of the contraction; hoisted, absorb_transposes folds them in and SM takes the scale."""

    @main_pass("HoistOperandScales")
    def rewrite(mod, func):
        values, users = bindings_of(func), users_of(func)

        def scaled(var):
            value = values.get(var)
            if call_op(value) != "relax.multiply" or users.get(var, 0) != 1:
                return None
            for x, c in (value.args, value.args[::-1]):
                factor = _scalar_constant(c)
                if factor is not None and rank(x) == 4:
                    return x, factor, c.value.dtype
            return None

        targets = {}
        for var, value in values.items():
            if call_op(value) == "relax.matmul" and rank(var) == 4:
                a, b = (scaled(arg) if isinstance(arg, relax.Var) else None for arg in value.args)
                if a is not None and b is not None:
                    targets[var] = (a, b)
        if not targets:
            return None

        @relax.expr_functor.mutator
        class Hoist(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                if binding.var not in targets:
                    return super().visit_var_binding_(binding)
                (a, ca, dtype), (b, cb, _) = targets[binding.var]
                bb = self.builder_
                product = bb.emit(relax.op.matmul(self.visit_expr(a), self.visit_expr(b)))
                scale = relax.const(ca * cb, str(dtype))
                emit = bb.emit if isinstance(binding.var, relax.DataflowVar) else bb.emit_output  # a block output
                self.set_var_remap(binding.var, emit(relax.op.multiply(product, scale)))
                return None

        return Hoist(mod).visit_expr(func).body

    # the operands' multiplies are dead once the contraction reads a and b
    return tvm.transform.Sequential([rewrite, relax.transform.DeadCodeElimination()],
                                    name="tvmdm.HoistOperandScales")


def drop_noop_reshapes() -> tvm.transform.Pass:
    """reshape(x) to x's own shape -> x (the legacy exporter writes one between the context contraction and
    its transpose, which would keep absorb_transposes from folding that transpose in)."""

    @main_pass("DropNoopReshapes")
    def rewrite(mod, func):
        values = bindings_of(func)
        same = {var for var, value in values.items() if call_op(value) == "relax.reshape"
                and tvm_ffi.structural_equal(var.ty, value.args[0].ty)}
        if not same:
            return None

        @relax.expr_functor.mutator
        class Drop(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                if binding.var not in same:
                    return super().visit_var_binding_(binding)
                self.set_var_remap(binding.var, self.visit_expr(values[binding.var].args[0]))
                return None

        return Drop(mod).visit_expr(func).body

    return rewrite


# --- transposes folded into the attention contractions -------------------------------------------------


def _compose(outer: list[int], inner: list[int]) -> list[int]:
    """permute(permute(x, inner), outer) == permute(x, [inner[o] for o in outer])."""
    return [inner[o] for o in outer]


HEAD_MAJOR = (0, 2, 1, 3)  # [B, S, h, d] <-> [B, h, S, d]; its own inverse


def absorb_transposes(qkv: str = "bshd", ctx: str = "bshd") -> tvm.transform.Pass:
    """matmul(permute_dims(a), permute_dims(b)) and permute_dims(matmul(a, b)) (4-D, the attention's batched
    contractions) become one einsum, when the permute_dims has no other reader.

    The layouts are the paper's choices for the tensors around those contractions: ``qkv`` is the layout the
    contractions read Q, K and V in: "bshd" (where the projection wrote them: no copy) or "bhsd" (a head-major
    copy is made first, one transpose each); ``ctx`` is the layout the context contraction writes: "bshd"
    (what the output projection reads) or "bhsd" (then transposed for it)."""
    for name, value in (("qkv", qkv), ("ctx", ctx)):
        if value not in ATTENTION_LAYOUTS:
            raise ValueError(f"unknown {name} layout {value!r}; choose one of {list(ATTENTION_LAYOUTS)}")

    @main_pass("AbsorbTransposes")
    def rewrite(mod, func):
        values = bindings_of(func)
        users = users_of(func)

        def unpermute(var):
            """(source, axes) with permute chains of single-use vars followed back; axes None: no permute."""
            axes = None
            while isinstance(var, relax.Var) and call_op(values.get(var)) == "relax.permute_dims" and \
                    users.get(var, 0) == 1:
                inner = permutation(values[var])
                axes = inner if axes is None else _compose(axes, inner)
                var = values[var].args[0]
            return var, axes

        # matmuls (4-D x 4-D) whose operands or single consumer are permute_dims
        targets = {}
        consumer_perm = {}
        for var, value in values.items():
            if call_op(value) == "relax.permute_dims" and call_op(values.get(value.args[0])) == "relax.matmul" \
                    and users.get(value.args[0], 0) == 1:
                consumer_perm[value.args[0]] = var
        for var, value in values.items():
            if call_op(value) != "relax.matmul" or rank(value.args[0]) != 4 or rank(value.args[1]) != 4:
                continue
            (a, pa), (b, pb) = unpermute(value.args[0]), unpermute(value.args[1])
            if pa is None and pb is None and var not in consumer_perm:
                continue
            targets[var] = (a, pa, b, pb)
        if not targets:
            return None
        out_of = {consumer_perm[v]: v for v in targets if v in consumer_perm}

        def subscripts(pa, pb, pc):
            # matmul labels: a=[b0,b1,i,j], b=[b0,b1,j,k], c=[b0,b1,i,k]
            la, lb, lc = "abij", "abjk", "abik"

            def source(labels, perm):  # labels of the unpermuted tensor: axis perm[t] carries labels[t]
                if perm is None:
                    return labels
                out = [""] * 4
                for t, p in enumerate(perm):
                    out[p] = labels[t]
                return "".join(out)

            out = lc if pc is None else "".join(lc[p] for p in pc)
            return (source(la, pa), source(lb, pb)), out

        @relax.expr_functor.mutator
        class Absorb(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                var = binding.var
                if var in targets and var in consumer_perm:
                    return None  # emitted at its permute_dims consumer
                if var in targets or var in out_of:
                    mm = out_of.get(var, var)
                    a, pa, b, pb = targets[mm]
                    pc = permutation(values[var]) if var in out_of else None
                    ins, out = subscripts(pa, pb, pc)
                    operands = []
                    for src, perm, labels in ((a, pa, ins[0]), (b, pb, ins[1])):
                        src = self.visit_expr(src)
                        if perm is not None and qkv == "bhsd":  # read a head-major copy
                            src = self.builder_.emit(relax.op.permute_dims(src, HEAD_MAJOR))
                            labels = "".join(labels[i] for i in HEAD_MAJOR)
                        operands.append((src, labels))
                    head_major_out = pc is not None and ctx == "bhsd"
                    if head_major_out:
                        out = "".join(out[i] for i in HEAD_MAJOR)
                    eq = f"{operands[0][1]},{operands[1][1]}->{out}"
                    new = self.builder_.emit(relax.op.einsum([src for src, _ in operands], eq))
                    if head_major_out:  # back to the layout the consumer reads
                        new = self.builder_.emit(relax.op.permute_dims(new, HEAD_MAJOR))
                    self.set_var_remap(var, new)
                    return None
                return super().visit_var_binding_(binding)

        return Absorb(mod).visit_expr(func).body

    # the permute_dims that fed the einsums are dead once they are gone
    return tvm.transform.Sequential([rewrite, relax.transform.DeadCodeElimination()],
                                    name="tvmdm.AbsorbTransposes")


def paper_graph_rewrites(layout: str = DEFAULT_LAYOUT, batched_attention: bool = False) -> tvm.transform.Pass:
    """The graph rewrites of the "paper" level (on ``main``; a training step applies them before Gradient,
    so the backward graph inherits the merged QKV and the transpose-free attention).

    ``batched_attention`` (the attention's contractions on matrix units: core.target.attention_on_matrix_units):
    the attention keeps its transposes and batched matmuls, one contraction a kernel, as the matrix units'
    schedules take them (schedules.tensor_cores, schedules.amx). On CUDA a transpose moves its 1.5 MB (Q, K or V
    at (8, 128)) in about a microsecond; the einsums the transposes fold into, fused with the softmax, ran on
    the SIMT units at an estimated 0.3-0.5 ms, more than the layer's fp16 GEMMs together. In bf16 on 2 Sapphire
    Rapids cores the base layer (8, 128) took 13.8 ms with the attention on tiles against 15.5 with the fp32
    einsums."""
    # The contractions keep the operand order ONNX gave their bias adds, so kernels the paper's rules leave
    # alone (the FFN's matmul + bias + GELU) are the very kernels stock fusion makes: their tuned records apply.
    passes = [merge_qkv(), fold_reshaped_transposes(), hoist_operand_scales(), drop_noop_reshapes()]
    if not batched_attention:
        passes.append(absorb_transposes(**parse_layout(layout)))
    return tvm.transform.Sequential(passes, name="tvmdm.PaperGraphRewrites")
