"""guard_gathers: no gather reads outside its table, and an index outside it is an error, not a wrong answer.

Preconditions: the imported graph (``main`` with dataflow blocks, before fusion; its "num_input" attribute
tells the inputs from the weights). Every ``take(table, indices)`` from a weight or constant table becomes
``take(..., mode="clip")`` (in range by construction: the ONNX frontend's "fast" mode reads past the table, a
crash or garbage), and the graph checks at run time that every index was in range: ``assert_op`` after the
dataflow block, with a message naming the input the indices come from, or, for indices the graph computes
(position ids from Range), the longest sequence the table allows. The check lives in the compiled module, so
no manifest can turn it off (the runner turns the failure into an InputError). On CUDA the same: the two
reductions run on the device and assert_op copies their boolean to the host (one scalar a call).

``guard_gathers(check=False)`` (a training graph, before its gradient: assert_op is impure, and the gradient
pass differentiates pure dataflow only) clips the indices themselves, so the forward gather and the gradient's
scatter both stay in the table; ``too_long_for_positions`` refuses at compile time a static graph whose
position ids outrun their table, and the step's runner checks the index inputs.
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.core.errors import INDEX_GUARD_MARK
from tvmdm.transform.ir import bindings_of, call_op

GUARD_MARK = INDEX_GUARD_MARK
_SAME_VALUES = ("relax.astype", "relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.permute_dims",
                "relax.flatten", "relax.broadcast_to")


def _source_input(var, values: dict, inputs: set):
    """The graph input whose values ``var`` carries (through casts and reshapes), or None."""
    while True:
        if var in inputs:
            return var
        value = values.get(var)
        if call_op(value) == "relax.where":  # the frontend's where(i < 0, i + rows, i): negative ids count back
            var = value.args[2]
        elif call_op(value) in _SAME_VALUES:
            var = value.args[0]
        else:
            return None


def _message(source, rows: int) -> str:
    if source is not None:
        return f"{GUARD_MARK}input {str(source.name)!r} holds index {{}}, outside [0, {rows}) of a table of {rows} rows"
    return (f"{GUARD_MARK}position {{}} is outside the model's position table of {rows} rows: sequences may be at "
            f"most {rows} tokens long")


def _gathers(func) -> tuple[dict, set, dict]:
    """(bindings, graph inputs, {var: rows} of every take from a weight or constant table by integer indices)."""
    n_in = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else len(func.params)
    inputs, tables = set(func.params[:n_in]), set(func.params[n_in:])
    values = bindings_of(func)
    rows = {var: int(value.args[0].ty.shape.values[int(value.attrs.axis)]) for var, value in values.items()
            if call_op(value) == "relax.take"
            and (value.args[0] in tables or isinstance(value.args[0], tvm.ir.expr.Constant))
            and "int" in str(value.args[1].ty.dtype) and len(value.args[0].ty.shape.values) >= 1}
    return values, inputs, rows


def too_long_for_positions(mod: tvm.IRModule) -> str | None:
    """Why a static ``main`` cannot run (position ids of more tokens than their table has rows), or None.

    Indices the graph computes (not an input: position ids from Range or a constant slice) over a static last
    axis of S tokens reach S - 1."""
    values, inputs, rows = _gathers(mod["main"])
    for var, n in rows.items():
        indices = values[var].args[1]
        shape = indices.ty.shape.values if indices.ty.shape is not None else []
        if _source_input(indices, values, inputs) is None and shape and isinstance(shape[-1], tvm.tirx.IntImm) \
                and int(shape[-1]) > n:
            return _message(None, n).replace(GUARD_MARK, "").format(int(shape[-1]) - 1)
    return None


def guard_gathers(check: bool = True) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="tvmdm.GuardGathers")
    def run(mod, _ctx):
        if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        func = mod["main"]
        values, inputs, guarded = _gathers(func)
        if not guarded:
            return mod
        checks = []

        @relax.expr_functor.mutator
        class Guard(relax.PyExprMutator):
            def visit_var_binding_(self, binding):
                if binding.var not in guarded:
                    return super().visit_var_binding_(binding)
                take = values[binding.var]
                table, indices = self.visit_expr(take.args[0]), self.visit_expr(take.args[1])
                axis, rows, bb = int(take.attrs.axis), guarded[binding.var], self.builder_
                if not check:
                    dtype = indices.ty.dtype
                    inside = relax.op.clip(indices, relax.prim_value(tvm.tirx.const(0, dtype)),
                                           relax.prim_value(tvm.tirx.const(rows - 1, dtype)))
                    bb.emit_normalized(relax.VarBinding(binding.var, bb.normalize(
                        relax.op.take(table, bb.emit(inside), axis=axis, mode="clip"))))
                    return None
                # the same var: a graph output (not a DataflowVar) stays one
                clipped = bb.normalize(relax.op.take(table, indices, axis=axis, mode="clip"))
                bb.emit_normalized(relax.VarBinding(binding.var, clipped))
                low, high = bb.emit(relax.op.min(indices)), bb.emit(relax.op.max(indices))
                in_range = relax.op.logical_and(relax.op.greater_equal(low, relax.const(0, low.ty.dtype)),
                                                relax.op.less(high, relax.const(rows, high.ty.dtype)))
                bad = relax.op.where(relax.op.less(low, relax.const(0, low.ty.dtype)), low, high)
                checks.append((bb.emit_output(in_range), bb.emit_output(bad),
                               _message(_source_input(take.args[1], values, inputs), rows)))
                return None

        body = Guard(mod).visit_expr(func).body
        if not check:
            out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
            out["main"] = relax.BlockBuilder(out).normalize(relax.Function(func.params, body, func.ret_ty,
                                                                           is_pure=func.is_pure, attrs=func.attrs))
            return out
        asserts = [relax.VarBinding(relax.Var("index_guard", relax.TupleType([])),
                                    relax.op.assert_op(ok, [bad], format=message)) for ok, bad, message in checks]
        # assert_op is impure, so main is too (well-formedness); normalized here so that no later mutator fills
        # in the new calls' types in place (that changes main's structural hash under a BlockBuilder's feet)
        guarded_main = relax.Function(func.params, relax.SeqExpr(list(body.blocks) + [relax.BindingBlock(asserts)],
                                                                 body.body), func.ret_ty, is_pure=False,
                                      attrs=func.attrs)
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        out["main"] = relax.BlockBuilder(out).normalize(guarded_main)
        return out

    return run
