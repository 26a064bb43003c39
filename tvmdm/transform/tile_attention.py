"""The attention as one kernel for the AMX tile units (bf16 inference on CPUs).

The batched contractions the paper level keeps for matrix units (core.target.attention_on_matrix_units) ran on
the tiles for static shapes as three kernels and their operands' packings, the fp32 scores and probabilities
in memory between them; a symbolic sequence could not use them at all and ran the paper's fp32 SM and context
(base layer bf16 at (1, 512) on 2 Sapphire Rapids cores: SM 2.6 ms and context 1.9, 45 % of the layer).
``tile_attention()`` replaces each SM / context pair, static or symbolic, with:

  tile_attention_q / _k / _v   Q, K and V (fp32 slices of the QKV output) -> bf16 bits in the tile kernel's
                               layouts (schedules.amx_attention), the keys padded with zeros to whole blocks of
                               ``KEY_BLOCK``; element-wise, so they fuse with the slices that feed them;
  tile_attention_mask          the additive mask -> [B, 1, L] fp32, or [B, L, L] where it has a row per query
                               (HF's exports expand it so), the padded keys -inf;
  tile_attention               ``attention_func``: softmax(Q K^T * scale + mask) V with bf16 operands and fp32
                               accumulation, [B, L, H, D]; schedules.amx_attention gives it the tile kernel;
  cut_keys                     its rows back to the sequence (attention_padding.cut_func), then the context's
                               own layout.

Preconditions: after the paper's pattern fusion (composites "tvmdm.sm" and "tvmdm.attention_context"), on
``main`` of an inference module; the pass only runs for bf16 on a CPU with AMX-BF16. A pair is left alone
(attention_padding pads it instead) unless SM is einsum -> [* or / a constant] -> [+ a mask [B, 1, 1 or S,
S]] -> softmax over the keys [-> NaNs to 0], its output read only by the context einsum,
queries and keys of one length and the head dim a multiple of 32. Measured (in place, same session): base
layer at (1, 512) 6.45 ms a layer against 7.21 with the static batched kernels, at (8, 128) and (1, 128) the
same within the VM's noise; symbolic at (1, 512) 7.14 against 10.15.
"""
from __future__ import annotations

import dataclasses

import tvm
import tvm.sym
from tvm import relax, te, tirx

from tvmdm.transform.attention_padding import CONTEXT, SM, composite_name, cut_func
from tvmdm.transform.ir import bindings_of, call_op, function_pass, readers_of, rewritten, scalar_constant
from tvmdm.transform.kernels import bf16_bits, bf16_value, private_func

KEY_BLOCK = 32  # keys of a tile block (2 tiles of 16 columns)
TILE_ATTENTION_ATTR = "tvmdm.tile_attention"  # (heads, head_dim, scale) of an attention_func kernel
KERNEL = "tile_attention"
OPERANDS = tuple(f"{KERNEL}_{kind}" for kind in "qkv")  # their blocks' names


def key_blocks(length):
    """Blocks of KEY_BLOCK keys that hold a sequence of ``length`` (the last one padded)."""
    return tvm.sym.Analyzer().simplify(tirx.floordiv(length + KEY_BLOCK - 1, KEY_BLOCK))


def operand_shape(kind: str, batch, heads, blocks, dim) -> tuple:
    """The tile kernel's layout of Q ("q": rows of d), K ("k": B tiles of 16 keys by pairs of d) or V ("v": B
    tiles of 16 columns of d by pairs of keys, a pair in one uint32), with ``blocks`` blocks of keys."""
    return {"q": (batch, heads, blocks * KEY_BLOCK, dim), "k": (batch, heads, blocks * 2, dim // 2, 16, 2),
            "v": (batch, heads, dim // 16, blocks * 16, 16)}[kind]


def operand_dtype(kind: str) -> str:
    return "uint32" if kind == "v" else "uint16"


def attention_func(heads: int, head_dim: int, scale: float, per_query: bool = False) -> tirx.PrimFunc:
    """(q, k, v, mask, blocks) -> out in the layouts of schedules.amx_attention's module doc, L = blocks *
    KEY_BLOCK: the reference semantics of the tile kernel (exact exp; a row of -inf keys gives 0). The mask is
    [B, L, L] where ``per_query``, else [B, 1, L]."""
    H, D = heads, head_dim
    batch, blocks = tirx.Var("batch", "int64"), tirx.Var("blocks", "int64")
    length = blocks * KEY_BLOCK
    q, k, v = (te.placeholder(operand_shape(kind, batch, H, blocks, D), operand_dtype(kind), name=kind)
               for kind in "qkv")
    mask = te.placeholder((batch, length if per_query else 1, length), "float32", name="mask")
    d = te.reduce_axis((0, D), name="d")
    scores = te.compute((batch, H, length, length), lambda b, h, i, j: te.sum(
        bf16_value(q[b, h, i, d]) * bf16_value(k[b, h, j // 16, d // 2, j % 16, d % 2]), axis=d), name="scores")
    logits = te.compute(scores.shape, lambda b, h, i, j: scores[b, h, i, j] * tirx.const(scale, "float32")
                        + mask[b, i if per_query else 0, j], name="logits")
    j = te.reduce_axis((0, length), name="j")
    top = te.compute((batch, H, length), lambda b, h, i: te.max(logits[b, h, i, j], axis=j), name="top")
    exp = te.compute(scores.shape, lambda b, h, i, j: tirx.exp(logits[b, h, i, j] - top[b, h, i]), name="exp")
    j2 = te.reduce_axis((0, length), name="j2")
    total = te.compute(top.shape, lambda b, h, i: te.sum(exp[b, h, i, j2], axis=j2), name="total")
    masked = tirx.const(float("-inf"), "float32")
    probs = te.compute(scores.shape, lambda b, h, i, j: bf16_bits(tirx.Select(
        top[b, h, i] == masked, tirx.const(0, "float32"), exp[b, h, i, j] / total[b, h, i])), name="probs")
    key = te.reduce_axis((0, length), name="key")
    out = te.compute((batch, length, H, D), lambda b, i, h, c: te.sum(
        bf16_value(probs[b, h, i, key]) * bf16_value(
            (v[b, h, c // 16, key // 2, c % 16] >> (16 * (key % 2)).astype("uint32")).astype("uint16")), axis=key),
        name="context")
    func = te.create_prim_func([q, k, v, mask, blocks, out])
    described = [H, D, tvm.runtime.convert(float(scale)), int(per_query)]
    return private_func(func).with_attr(TILE_ATTENTION_ATTR, described) \
        .with_attr("op_pattern", 8)  # a kernel of its own: nothing fuses into it


def _operand_func(shape, kind: str) -> tirx.PrimFunc:
    """x [B, H, S, D] fp32 -> its bf16 bits in the tile kernel's layout for ``kind`` ("q", "k" or "v"), S padded
    with zeros to whole blocks of KEY_BLOCK."""
    batch, seq = _dims(shape[0::2])
    heads, dim = (tirx.IntImm("int64", int(d)) for d in shape[1::2])
    x = te.placeholder((batch, heads, seq, dim), "float32", name="x")
    shape = operand_shape(kind, batch, heads, key_blocks(seq), dim)

    def bits(b, h, key, d):
        inside = key < seq
        return tirx.Select(inside, bf16_bits(x[b, h, tirx.min(key, seq - 1), d]), tirx.const(0, "uint16"))

    if kind == "q":
        out = te.compute(shape, bits, name="tile_attention_q")
    elif kind == "k":  # B tiles of Q K^T: 16 keys (columns) x pairs of d
        out = te.compute(shape, lambda b, h, kt, dp, c, p: bits(
            b, h, kt * 16 + c, dp * 2 + p), name="tile_attention_k")
    else:  # B tiles of P V: 16 columns of d x pairs of keys, a pair one uint32 (its first key's bits low): two
        # rows of V read as vectors make whole vectors of pairs (as [.., 16, 2] uint16 they were scattered)
        def pair(b, h, ct, kp, c):
            first, second = (bits(b, h, kp * 2 + p, ct * 16 + c).astype("uint32") for p in (0, 1))
            return first | (second << tirx.const(16, "uint32"))

        out = te.compute(shape, pair, name="tile_attention_v")
    return private_func(te.create_prim_func([x, out])).with_attr("op_pattern", 2)  # fuses with Q/K/V's slice


def _dims(dims) -> tuple:
    """(batch, seq) of a kernel: constants where the module's are, else its own vars (FuseTIR joins a kernel's
    buffers with its neighbours' only where their shapes agree in kind)."""
    return tuple(tirx.IntImm("int64", int(d)) if isinstance(d, tirx.IntImm) else tirx.Var(name, "int64")
                 for d, name in zip(dims, ("batch", "seq")))


def _per_query(shape) -> bool:
    """Whether a mask [B, 1, 1 or S, S] has a row per query."""
    return not (isinstance(shape[2], tirx.IntImm) and int(shape[2]) == 1)


def _mask_func(shape) -> tirx.PrimFunc:
    """The additive mask [B, 1, 1 or S, S] -> [B, 1 or L, L] fp32, the padded keys -inf (padded queries: 0)."""
    batch, seq = _dims(shape[0::3])
    one = tirx.IntImm("int64", 1)
    per_query = _per_query(shape)
    mask = te.placeholder((batch, one, seq if per_query else one, seq), "float32", name="mask")
    length = key_blocks(seq) * KEY_BLOCK
    last = seq - 1
    out = te.compute((batch, length if per_query else one, length), lambda b, i, j: tirx.Select(
        j < seq, mask[b, 0, tirx.min(i, last) if per_query else 0, tirx.min(j, last)],
        tirx.const(float("-inf"), "float32")), name="tile_attention_mask")
    return private_func(te.create_prim_func([mask, out]))


@dataclasses.dataclass
class _Pair:
    """An SM / context pair the tile kernel takes: the operands' expressions inside their composites, the
    permutations to [B, H, S, D], the scale, the mask (main's value), and the context's output axes."""
    sm: relax.Var
    q: tuple  # (composite, call args, operand expr, permutation)
    k: tuple
    v: tuple
    scale: float
    mask: relax.Expr
    heads: int
    head_dim: int
    length: tirx.PrimExpr  # the sequence: a symbolic var or a constant
    out_axes: list  # the context's output axes, as positions of the kernel's [B, L, H, D]


def tile_attention() -> tvm.transform.Pass:
    """See the module doc."""
    return function_pass("tvmdm.TileAttention", _rewrite_function, every_function=False)


def _einsum(func: relax.Function):
    """(its var, operands, (left labels, right labels, output labels)) of the composite's one einsum, else
    None."""
    found = [(var, value) for var, value in bindings_of(func).items() if call_op(value) == "relax.einsum"]
    if len(found) != 1:
        return None
    var, value = found[0]
    ins, out = str(value.attrs.subscripts).split("->")
    left, right = ins.split(",")
    return var, list(value.args[0].fields), (left, right, out)


def _constant(expr, args: dict):
    """The float of a scalar constant (or the composite parameter given one), else None."""
    value = scalar_constant(args.get(expr, expr))
    return None if value is None else float(value)


def _sm_chain(func: relax.Function, args: dict):
    """(scale, mask parameter) of SM = softmax(einsum [* or / constant] + mask) [NaNs -> 0], else None."""
    bindings = bindings_of(func)
    output = func.body.body
    value = bindings.get(output)
    if call_op(value) == "relax.where":  # where(isnan(probs), 0, probs): ours gives 0 for such rows
        test, zero, probs = value.args
        if call_op(bindings.get(test)) != "relax.isnan" or _constant(zero, args) != 0.0 or \
                not bindings[test].args[0].same_as(probs):
            return None
        output, value = probs, bindings.get(probs)
    if call_op(value) != "relax.nn.softmax" or int(value.attrs.axis) not in (-1, 3):
        return None
    value = bindings.get(value.args[0])
    if call_op(value) != "relax.add":
        return None
    logits, mask = value.args if value.args[1] in args else value.args[::-1]
    value, scale = bindings.get(logits), 1.0
    if call_op(value) in ("relax.multiply", "relax.divide"):
        factor = _constant(value.args[1], args)
        if factor is None or factor == 0.0:
            return None
        scale = factor if call_op(value) == "relax.multiply" else 1.0 / factor
        value = bindings.get(value.args[0])
    return (scale, args[mask]) if call_op(value) == "relax.einsum" and mask in args else None


def _same(a, b) -> bool:
    """Whether two dims are the same: one symbolic var, or equal constants."""
    return a.same_as(b) or (isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm) and int(a) == int(b))


def _perm(labels: str, order) -> list | None:
    return [labels.index(label) for label in order] if sorted(labels) == sorted(order) else None


def _plan_pair(mod, sm_call, sm_var, ctx_call) -> _Pair | None:
    sm_func, ctx_func = mod[sm_call.op], mod[ctx_call.op]
    sm_args, ctx_args = dict(zip(sm_func.params, sm_call.args)), dict(zip(ctx_func.params, ctx_call.args))
    found, context, chain = _einsum(sm_func), _einsum(ctx_func), _sm_chain(sm_func, sm_args)
    # the context composite is its einsum alone (its output)
    if None in (found, context, chain) or not ctx_func.body.body.same_as(context[0]):
        return None
    _, (left, right), (a, b, out) = found
    batch, heads, query, key = out
    batch_dim, head_dim_h, q_len, k_len = sm_var.ty.shape.values
    contracted = set(a) & set(b) - set(out)
    if len(out) != 4 or len(contracted) != 1 or not isinstance(head_dim_h, tirx.IntImm) or \
            not isinstance(k_len, (tirx.Var, tirx.IntImm)) or not _same(q_len, k_len):
        return None
    d = contracted.pop()
    if key in a:  # the keys' operand first
        (left, a), (right, b) = (right, b), (left, a)
    q_perm, k_perm = _perm(a, (batch, heads, query, d)), _perm(b, (batch, heads, key, d))
    _, (probs, values), (pa, va, ctx_out) = context
    if q_perm is None or k_perm is None or len(pa) != 4 or not ctx_args.get(probs, probs).same_as(sm_var):
        return None
    vd = set(va) & set(ctx_out) - set(pa)
    if len(vd) != 1:
        return None
    vd = vd.pop()
    v_perm = _perm(va, (pa[0], pa[1], pa[3], vd))
    out_axes = _perm("".join((pa[0], pa[2], pa[1], vd)), ctx_out) if v_perm else None
    head_dim = left.ty.shape.values[q_perm[3]]
    scale, mask = chain
    mask_dims = getattr(mask.ty, "shape", None)
    if out_axes is None or not isinstance(head_dim, tirx.IntImm) or int(head_dim) % 32 or mask_dims is None \
            or len(mask_dims.values) != 4 or mask.ty.dtype != "float32" \
            or not (isinstance(mask_dims.values[1], tirx.IntImm) and int(mask_dims.values[1]) == 1) \
            or not (_same(mask_dims.values[2], q_len) or not _per_query(mask_dims.values)) \
            or not _same(mask_dims.values[0], batch_dim) \
            or not _same(mask_dims.values[3], k_len):
        return None
    return _Pair(sm_var, (sm_func, sm_args, left, q_perm), (sm_func, sm_args, right, k_perm),
                 (ctx_func, ctx_args, values, v_perm), scale, mask, int(head_dim_h), int(head_dim), k_len, out_axes)


def _plan(mod: tvm.IRModule, func: relax.Function) -> dict:
    """context var -> its _Pair, for each SM read only by one context that the tile kernel takes."""
    bindings = bindings_of(func)
    readers = readers_of(func)
    plan = {}
    for var, value in bindings.items():
        users = readers.get(var, [])
        if composite_name(mod, value) != SM or len(users) != 1 or composite_name(mod, bindings[users[0]]) != CONTEXT:
            continue
        pair = _plan_pair(mod, value, var, bindings[users[0]])
        if pair is not None:
            plan[users[0]] = pair
    return plan


def _rewrite_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    plan = _plan(mod, mod[name])
    if not plan:
        return mod
    dropped = {pair.sm for pair in plan.values()}

    @relax.expr_functor.mutator
    class TileAttention(relax.PyExprMutator):
        def _operand(self, operand, kind: str, blocks):
            func, args, expr, perm = operand
            bindings = bindings_of(func)

            def emit(e):  # the composite's chain to its operand, re-made in main on the call's arguments
                if e in args:
                    return self.visit_expr(args[e])
                if not isinstance(e, relax.Var):
                    return e
                value = bindings[e]
                return self.builder_.emit(relax.Call(value.op, [emit(a) for a in value.args], value.attrs,
                                                     value.ty_args))

            x = emit(expr)
            if perm != [0, 1, 2, 3]:
                x = self.builder_.emit(relax.op.permute_dims(x, perm))
            batch, heads, _, dim = x.ty.shape.values
            shape = list(operand_shape(kind, batch, heads, blocks, dim))
            gv = self.builder_.add_func(_operand_func(x.ty.shape.values, kind), f"tile_attention_{kind}")
            return self.builder_.emit(relax.call_tir(gv, [x], relax.TensorType(shape, operand_dtype(kind))))

        def visit_var_binding_(self, binding):
            if binding.var in dropped:
                return None  # computed inside the tile kernel
            pair = plan.get(binding.var)
            if pair is None:
                return super().visit_var_binding_(binding)
            bb, length = self.builder_, pair.length
            blocks = key_blocks(length)
            q, k, v = (self._operand(o, kind, blocks) for o, kind in ((pair.q, "q"), (pair.k, "k"), (pair.v, "v")))
            batch = q.ty.shape.values[0]
            padded = blocks * KEY_BLOCK
            mask_shape = pair.mask.ty.shape.values
            per_query = _per_query(mask_shape)
            rows = padded if per_query else tirx.IntImm("int64", 1)
            mask = bb.emit(relax.call_tir(bb.add_func(_mask_func(mask_shape), "tile_attention_mask"),
                                          [self.visit_expr(pair.mask)],
                                          relax.TensorType([batch, rows, padded], "float32")))
            kernel = bb.add_func(attention_func(pair.heads, pair.head_dim, pair.scale, per_query), KERNEL)
            heads, dim = (tirx.IntImm("int64", n) for n in (pair.heads, pair.head_dim))
            shape = [batch, padded, heads, dim]
            out = bb.emit(relax.call_tir(kernel, [q, k, v, mask, blocks], relax.TensorType(shape, "float32")))
            real = [batch, length, heads, dim]
            if not (isinstance(length, tirx.IntImm) and int(length) % KEY_BLOCK == 0):  # else nothing padded
                out = bb.emit(relax.call_tir(bb.add_func(cut_func(shape, real, "float32"), "cut_keys"), [out],
                                             relax.TensorType(real, "float32")))
            if pair.out_axes != [0, 1, 2, 3]:
                out = bb.emit(relax.op.permute_dims(out, pair.out_axes))
            self.set_var_remap(binding.var, out)
            return None

    return rewritten(mod, name, TileAttention(mod))
