"""The paper's backward kernels as dataflow patterns over the graph Relax's Gradient writes (fusion="paper" in
a training step); FuseOpsByPattern makes each match one kernel and fuse.inline_pattern_kernels keeps its
element-wise intermediates out of memory.

  blnrd - LayerNorm's input gradient: the statistics recomputed, dx = rstd * (dxhat - mean(dxhat)
          - xhat * mean(dxhat * xhat)) with dxhat = dy * gamma, in one pass over each row (stock fusion: five
          kernels and four row-sized intermediates). The residual's gradient is added where it is produced
          (the input-gradient contraction's epilogue), dropout's mask by the next kernel.
  bsb   - LayerNorm's scale and bias gradients, sum(dy * xhat) and sum(dy) over the rows, side by side in one
          reduction with the statistics recomputed: one kernel reading dy once (stock: three or more).
  bs    - softmax's gradient with the scale folded in: (dp - sum(dp * p)) * p * scale, one kernel (stock: three).
  bdrb  - the FFN's GELU gradient dy * (Phi(x) + x * phi(x)) from the pre-activation x alone (recompute_gelu_gradient
          rewrites Gradient's form, which read two forward intermediates and took 3-4 kernels and 4 intermediates
          of [B, S, 4H]); the forward GELU, no longer read by the backward pass, fuses into one kernel too. The
          bias gradient (the column sum of its result) stays a kernel of its own (schedules.reductions).

They match what tvmdm.train.relax_fixes' LayerNorm gradient and TVM's softmax gradient emit (tests check that they do).
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple, wildcard

from tvmdm.transform.ir import bindings_of, call_op, function_pass, rewritten

BACKWARD_KERNELS = ("blnrd", "bsb", "bs", "bdrb")


def _mean(x):
    return is_op("relax.mean")(x)


def _multiply(a, b):
    return is_op("relax.multiply")(a, b)


def _normalized(x):
    """(xhat, rstd) of LayerNorm's recomputed statistics of ``x``, as the gradient writes them."""
    centered = is_op("relax.subtract")(x, _mean(x))
    rstd = is_op("relax.rsqrt")(is_op("relax.add")(_mean(_multiply(centered, centered)), is_const()))
    return _multiply(centered, rstd), rstd


def blnrd_pattern():
    x, gamma, dy = wildcard(), wildcard(), wildcard()
    xhat, rstd = _normalized(x)
    dxhat = _multiply(dy, gamma)
    centered_grad = is_op("relax.subtract")(dxhat, _mean(dxhat))
    projection = _multiply(xhat, _mean(_multiply(dxhat, xhat)))
    return _multiply(rstd, is_op("relax.subtract")(centered_grad, projection))


def bsb_pattern():
    x, dy = wildcard(), wildcard()
    xhat, _ = _normalized(x)
    return is_op("relax.sum")(is_op("relax.concat")(is_tuple([_multiply(dy, xhat), dy])))


def bs_pattern():
    probs, grad = wildcard(), wildcard()
    softmax_grad = _multiply(is_op("relax.subtract")(grad, is_op("relax.sum")(_multiply(grad, probs))), probs)
    return _multiply(softmax_grad, is_const()) | is_op("relax.divide")(softmax_grad, is_const()) | softmax_grad


def _gradient_gelu_pattern():
    """(pattern, dy, x): Gradient's form of d/dx of GELU(x) = x * 0.5 * (1 + erf(x / sqrt2)), times dy:
    dy*0.5 * (1 + erf(s)) + dy*0.5 * x * 2/sqrt(pi) * exp(-s*s) / sqrt2, s = x / sqrt2 (s and 1 + erf(s) are the
    forward's own values)."""
    dy, x = wildcard(), wildcard()
    s = is_op("relax.divide")(x, is_const())
    half = _multiply(dy, is_const())
    cdf_term = _multiply(half, is_op("relax.add")(is_op("relax.erf")(s), is_const()))
    density = is_op("relax.exp")(is_op("relax.negative")(_multiply(s, s)))
    pdf_term = is_op("relax.divide")(_multiply(_multiply(_multiply(half, x), is_const()), density), is_const())
    return is_op("relax.add")(cdf_term, pdf_term), dy, x


def _gelu_gradient(emit, dy: relax.Expr, x: relax.Expr) -> relax.Expr:
    """dy * (Phi(x) + x * phi(x)) from x alone, each op bound by ``emit``."""
    dtype = x.ty.dtype

    def const(value):
        return relax.const(value, dtype)

    op = relax.op
    s = emit(op.divide(x, const(math.sqrt(2.0))))
    cdf = emit(op.multiply(emit(op.add(emit(op.erf(s)), const(1.0))), const(0.5)))
    density = emit(op.exp(emit(op.negative(emit(op.multiply(s, s))))))
    pdf = emit(op.multiply(density, const(1.0 / math.sqrt(2 * math.pi))))
    return op.multiply(dy, emit(op.add(cdf, emit(op.multiply(x, pdf)))))


def recompute_gelu_gradient() -> tvm.transform.Pass:
    """Every GELU gradient as Gradient writes it -> _gelu_gradient of the same dy and x (a training module's
    functions; a no-op where there is none). Bound op by op, so no other binding changes (the LayerNorm
    patterns need theirs as they are)."""
    pattern, dy, x = _gradient_gelu_pattern()

    def rewrite(mod: tvm.IRModule, name: str) -> tvm.IRModule:
        values = bindings_of(mod[name])
        found = {var: matches for var, value in values.items() if not isinstance(value, relax.Var)  # not aliases
                 and (matches := pattern.extract_matched_expr(value, values)) is not None}
        if not found:
            return mod

        @relax.expr_functor.mutator
        class Recompute(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                matches = found.get(binding.var)
                if matches is None:
                    return super().visit_var_binding_(binding)
                pre_activation = self.visit_expr(matches[x])
                if call_op(values.get(matches[x])) == "relax.add":  # the bias add again, read by this kernel alone
                    pre_activation = self.builder_.emit(relax.op.add(*map(self.visit_expr, values[matches[x]].args)))
                value = _gelu_gradient(self.builder_.emit, self.visit_expr(matches[dy]), pre_activation)
                self.set_var_remap(binding.var, self.builder_.emit(value))

        out = rewritten(mod, name, Recompute(mod))
        out[name] = relax.analysis.remove_all_unused(out[name])
        return out

    return function_pass("tvmdm.RecomputeGeluGradient", rewrite)


def bdrb_pattern():
    dy, x = wildcard(), is_op("relax.add")(wildcard(), wildcard()) | wildcard()  # with the bias add
    s = is_op("relax.divide")(x, is_const())
    cdf = _multiply(is_op("relax.add")(is_op("relax.erf")(s), is_const()), is_const())
    pdf = _multiply(is_op("relax.exp")(is_op("relax.negative")(_multiply(s, s))), is_const())
    return _multiply(dy, is_op("relax.add")(cdf, _multiply(x, pdf)))


def backward_patterns() -> list[tuple[str, object]]:
    """(kernel name, pattern), most specific first."""
    return [("blnrd", blnrd_pattern()), ("bsb", bsb_pattern()), ("bs", bs_pattern()), ("bdrb", bdrb_pattern())]
