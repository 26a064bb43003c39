"""Whole-tensor max / min as a row reduction, then a reduction of the rows' results.

DynamicQuantizeLinear (onnxruntime's dynamic quantization, before every int8 contraction) takes the max and the
min of its whole input to choose the scale. LegalizeOps writes ``max(x, axis=None)`` as one serial reduction
over every element: the schedules cannot split it over the cores (1.7 ms for [8, 128, 3072] on 2 Zen 4 cores). Written as ``max(max(x, axis=-1), axis=None)`` the rows reduce in parallel (vectorized),
and the second reduction reads one value per row. max and min are exact in any order: the results are the same.

Precondition: none (a tensor of rank < 2, or already reduced by axis, is left as it is).
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.transform.ir import call_op, function_pass, rewritten

WHOLE_TENSOR_REDUCTIONS = {"relax.max": relax.op.max, "relax.min": relax.op.min}


def _whole_tensor(value) -> bool:
    if call_op(value) not in WHOLE_TENSOR_REDUCTIONS or value.attrs.axis is not None or value.attrs.keepdims:
        return False
    shape = getattr(value.args[0].ty, "shape", None)
    return shape is not None and len(shape.values) >= 2


def rows_then_whole() -> tvm.transform.Pass:
    """max(x) / min(x) over every element of x (rank >= 2) -> the same over the rows' max / min; see the
    module doc."""
    return function_pass("tvmdm.RowsThenWhole", _rewrite_function)


def _rewrite_function(mod: tvm.IRModule, name: str) -> tvm.IRModule:
    func = mod[name]
    if not any(_whole_tensor(b.value) for block in func.body.blocks for b in block.bindings):
        return mod

    @relax.expr_functor.mutator
    class RowsThenWhole(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            if not _whole_tensor(binding.value):
                return super().visit_var_binding_(binding)
            reduce = WHOLE_TENSOR_REDUCTIONS[call_op(binding.value)]
            rows = self.builder_.emit(reduce(self.visit_expr(binding.value.args[0]), axis=[-1]))
            self.set_var_remap(binding.var, self.builder_.emit(reduce(rows)))
            return None

    return rewritten(mod, name, RowsThenWhole(mod))
