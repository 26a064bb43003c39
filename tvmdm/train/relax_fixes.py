"""What TVM 0.27's relax.transform.Gradient lacks for BERT: gradients of erf, GELU, LayerNorm, strided_slice,
einsum, squeeze; take with N-d indices; a cross-entropy whose gradient legalizes. Regression tests in
tests/train/test_relax_fixes.py show each is still missing in TVM."""
from __future__ import annotations


# Gradients 0.27's relax.transform.Gradient lacks (it fails with "has no FPrimalGradient"). Registered once,
# only where TVM has none, so an upgrade that adds its own keeps it (and tests/train/test_relax_fixes.py shows that it did).
GRADIENTS_ADDED: list[str] = []


def register_missing_gradients() -> None:
    import math

    import tvm
    from tvm import relax
    from tvm.relax.op.base import register_gradient

    def missing(name: str) -> bool:
        return tvm.ir.Op.get(name).get_attr("FPrimalGradient") is None and name not in GRADIENTS_ADDED

    def const(value, like):
        return relax.const(value, like.ty.dtype)

    if missing("relax.erf"):
        @register_gradient("relax.erf")
        def erf_grad(orig_var, orig_call, output_grad, ctx):  # d erf(x) = 2/sqrt(pi) exp(-x^2)
            x = orig_call.args[0]
            return [output_grad * const(2.0 / math.sqrt(math.pi), x) * relax.op.exp(relax.op.negative(x * x))]

        GRADIENTS_ADDED.append("relax.erf")

    if missing("relax.nn.gelu"):
        @register_gradient("relax.nn.gelu")
        def gelu_grad(orig_var, orig_call, output_grad, ctx):  # Phi(x) + x phi(x)
            x = orig_call.args[0]
            cdf = const(0.5, x) * (const(1.0, x) + relax.op.erf(x * const(1 / math.sqrt(2.0), x)))
            pdf = const(1 / math.sqrt(2 * math.pi), x) * relax.op.exp(const(-0.5, x) * x * x)
            return [output_grad * (cdf + x * pdf)]

        GRADIENTS_ADDED.append("relax.nn.gelu")

    if missing("relax.nn.layer_norm"):
        @register_gradient("relax.nn.layer_norm")
        def layer_norm_grad(orig_var, orig_call, output_grad, ctx):
            # Recompute the statistics (cheaper than keeping them: one pass over x); the usual closed form
            # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma.
            x, gamma, _ = orig_call.args
            ndim = x.ty.ndim
            axes = [int(a) % ndim for a in orig_call.attrs.axes]
            batch_axes = [a for a in range(ndim) if a not in axes]

            def normalized():
                centered = ctx.normalize(x - relax.op.mean(x, axes, keepdims=True))
                var = relax.op.mean(centered * centered, axes, keepdims=True)
                rstd = ctx.normalize(relax.op.rsqrt(var + const(float(orig_call.attrs.epsilon), x)))
                return ctx.normalize(centered * rstd), rstd

            xhat, rstd = normalized()
            dxhat = ctx.normalize(output_grad * gamma)
            dx = rstd * (dxhat - relax.op.mean(dxhat, axes, keepdims=True)
                         - xhat * relax.op.mean(dxhat * xhat, axes, keepdims=True))
            # The parameter gradients normalize x on their own and sum [dy * xhat, dy] (side by side) in one
            # reduction: one kernel reading dy once, the paper's BSB, apart from BLNRD (dx) so that its fusion
            # makes each one kernel (tvmdm.train.backward_kernels); for stock fusion tvmdm.train.step shares the
            # statistics again (EliminateCommonSubexpr).
            xhat_params, _ = normalized()
            if len(axes) != 1:
                return [dx, relax.op.sum(output_grad * xhat_params, batch_axes), relax.op.sum(output_grad, batch_axes)]
            both = ctx.normalize(relax.op.sum(relax.op.concat([output_grad * xhat_params, output_grad], axes[0]),
                                              batch_axes))
            halves = ctx.normalize(relax.op.split(both, 2, axis=0))
            return [dx, relax.TupleGetItem(halves, 0), relax.TupleGetItem(halves, 1)]

        GRADIENTS_ADDED.append("relax.nn.layer_norm")

    if missing("relax.strided_slice"):
        @register_gradient("relax.strided_slice")
        def strided_slice_grad(orig_var, orig_call, output_grad, ctx):
            # Unit-stride slices (what exporters write for x[:, 0] and friends): zero-pad the gradient back.
            x = orig_call.args[0]
            shape = [int(d) for d in x.ty.shape]
            pad = [0] * (2 * len(shape))
            axes, begins, ends = ([int(f.value) for f in orig_call.args[i].fields] for i in (1, 2, 3))
            strides = [int(f.value) for f in orig_call.args[4].fields] if len(orig_call.args) > 4 else [1] * len(axes)
            for axis, begin, end, stride in zip(axes, begins, ends, strides):
                if stride != 1:
                    raise NotImplementedError(f"gradient of strided_slice with stride {stride} (axis {axis})")
                size = shape[axis]
                begin = min(max(begin + size if begin < 0 else begin, 0), size)
                end = min(max(end + size if end < 0 else end, 0), size)
                pad[2 * axis], pad[2 * axis + 1] = begin, size - end
            return [relax.op.nn.pad(output_grad, pad), *[no_grad(a) for a in orig_call.args[1:]]]

        GRADIENTS_ADDED.append("relax.strided_slice")

    if missing("relax.einsum"):
        @register_gradient("relax.einsum")
        def einsum_grad(orig_var, orig_call, output_grad, ctx):
            # Two operands, each index once per operand (what attention written as einsum uses, e.g.
            # "bhqd,bhkd->bhqk"): d/dA of einsum(a,b->o) is einsum(o,b->a)(grad, B), and likewise for B.
            subscripts = str(orig_call.attrs.subscripts).replace(" ", "")
            inputs, out = subscripts.split("->")
            operands = list(orig_call.args[0].fields)
            terms = inputs.split(",")
            if len(terms) != 2 or any(len(set(t)) != len(t) for t in terms) or \
                    any(set(a) - set(out) - set(b) for a, b in (terms, terms[::-1])):
                raise NotImplementedError(f"gradient of einsum {subscripts!r}: only two operands without "
                                          "repeated or operand-only indices")
            a, b = terms
            grads = [relax.op.einsum([output_grad, operands[1]], f"{out},{b}->{a}"),
                     relax.op.einsum([output_grad, operands[0]], f"{out},{a}->{b}")]
            return [relax.Tuple(grads)]

        GRADIENTS_ADDED.append("relax.einsum")

    if missing("relax.squeeze"):
        @register_gradient("relax.squeeze")
        def squeeze_grad(orig_var, orig_call, output_grad, ctx):  # the dropped unit axes come back
            return [relax.op.reshape(output_grad, orig_call.args[0].ty.shape)]

        GRADIENTS_ADDED.append("relax.squeeze")

    # Ops whose results carry no gradient (integer-valued masks and labels) but that Gradient still asks
    # about when their output meets a differentiable value in a multiply; no_grad itself is one of them.
    for name in ("relax.one_hot", "relax.grad.no_grad"):
        if missing(name):
            register_gradient(name)(lambda orig_var, orig_call, output_grad, ctx:
                                    [no_grad(a) for a in orig_call.args])
            GRADIENTS_ADDED.append(name)


def no_grad(expr):
    from tvm.relax.op.grad import no_grad as mark

    return mark(expr)


def flatten_take_indices():
    """Relax pass: take(x, idx) with 0-d or N-d indices -> reshape(take(x, reshape(idx, [-1])), ...).

    0.27's legalization of take's gradient (relax.grad.take_backward) asserts 1-d indices; embedding
    lookups of [batch, seq] token ids are 2-d, x[:, 0] picks by a 0-d index. Same values forward; the gradient then legalizes."""
    import tvm
    from tvm import relax

    take_op = tvm.ir.Op.get("relax.take")

    @relax.expr_functor.mutator
    class Flatten(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not call.op.same_as(take_op) or len(call.args[1].ty.shape) == 1:
                return call
            data, indices = call.args
            axis = int(call.attrs.axis) % data.ty.ndim
            shape = [int(d) for d in call.ty.shape]
            flat = self.builder_.emit(relax.op.take(data, relax.op.reshape(indices, [-1]), axis=axis,
                                                     mode=str(call.attrs.mode)))
            return relax.op.reshape(flat, shape)

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.FlattenTakeIndices")
    def flatten(mod, _ctx):
        mutator = Flatten(mod)
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                mutator.builder_.update_func(gv, mutator.visit_expr(func))
        return mutator.builder_.get()

    return flatten


def cross_entropy(logits, labels, classes: int, ignore_index: int, dtype: str = "float32"):
    """Mean cross-entropy of logits [N, C] against int labels [N], skipping ``ignore_index``, as torch's.

    Not ``nn.nll_loss``: 0.27 legalizes its gradient (nll_loss_backward) by reading class weights at the
    label (``T_full[y[i]]``), out of bounds for an ignored label (-100), and counts every row in the mean's
    denominator once the constant weights are inlined: the gradients of a batch with ignored labels came out
    scaled by valid/total. one_hot of an ignored label is an all-zero row, so this form needs no special case.
    An all-ignored batch gives loss 0 (torch gives nan)."""
    from tvm import relax

    log_probs = relax.op.nn.log_softmax(logits, axis=-1)
    # labels carry no gradient: no_grad keeps Gradient from asking for one_hot's (it has none)
    one_hot = no_grad(relax.op.astype(relax.op.one_hot(labels, 1.0, 0.0, classes), dtype))
    picked = relax.op.multiply(one_hot, log_probs)
    valid = no_grad(relax.op.astype(relax.op.not_equal(labels, relax.const(ignore_index, "int64")), dtype))
    count = relax.op.maximum(relax.op.sum(valid), relax.const(1.0, dtype))
    return relax.op.divide(relax.op.negative(relax.op.sum(picked)), count)
