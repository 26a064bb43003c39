"""Relax IR helpers every graph pass uses (these rewrites, fusion's analyses, precision, training's passes)."""

from __future__ import annotations

import re

import tvm
from tvm import relax, tirx
from tvm.s_tir import Schedule


def call_op(value) -> str | None:
    """The op name of a Relax call binding's value ("relax.matmul"), None for anything else. Every graph pass
    (these rewrites, fusion's analyses, training's checkpoint and dropout) finds its places by it."""
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else None


def rank(expr) -> int | None:
    shape = getattr(expr.ty, "shape", None)
    return None if shape is None else len(shape.values)


def permutation(call: relax.Call) -> list[int]:
    """The axes of a relax.permute_dims call: its attribute, or all axes reversed (what no attribute means)."""
    if call.attrs.axes is not None:
        return [int(a) for a in call.attrs.axes]
    return list(reversed(range(rank(call.args[0]))))


def bindings_of(func: relax.Function) -> dict:
    """var -> bound value, over every binding block of ``func``."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def users_of(func: relax.Function) -> dict:
    """var -> number of bindings (and the function result) that read it."""
    counts: dict = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    for block in func.body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, count)
    relax.analysis.post_order_visit(func.body.body, count)
    return counts


def readers_of(func: relax.Function) -> dict:
    """var -> the binding vars whose calls take it as an argument, directly or in a tuple argument (call_tir's
    arguments, concat's)."""
    readers: dict = {}
    for var, value in bindings_of(func).items():
        for arg in getattr(value, "args", []):
            for read in arg.fields if isinstance(arg, relax.Tuple) else [arg]:
                if isinstance(read, relax.Var):
                    readers.setdefault(read, []).append(var)
    return readers


def scalar_constant(expr):
    """The value of a one-element constant as a 0-d numpy array of its dtype, else None."""
    if isinstance(expr, tvm.ir.expr.Constant) and isinstance(expr.value, tvm.runtime.Tensor):
        value = expr.value.numpy()
        if value.size == 1:
            return value.reshape(())
    return None


def static_shape(expr) -> list[int] | None:
    """The concrete dims of a tensor expression, None when any is symbolic."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape.values):
        return None
    return [int(d) for d in shape.values]


def has_symbolic_inputs(mod: tvm.IRModule) -> bool:
    """Whether any tensor input of ``main`` has a symbolic dim."""
    return any(getattr(p.ty, "shape", None) is not None and static_shape(p) is None for p in mod["main"].params)


def function_pass(pass_name: str, rewrite_function, every_function: bool = True) -> tvm.transform.Pass:
    """A module pass applying ``rewrite_function(mod, name) -> mod`` to every Relax function (a training
    module: main, loss_and_grads, train_step, apply_update), or to ``main`` alone."""

    @tvm.transform.module_pass(opt_level=0, name=pass_name)
    def run(mod, _ctx):
        names = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)
                 and (every_function or gv.name_hint == "main")]
        for name in names:
            mod = rewrite_function(mod, name)
        return mod

    return run


def mutator_pass(pass_name: str, make_mutator) -> tvm.transform.Pass:
    """A module pass visiting every Relax function of the module (composite functions and a training module's
    too) with ``make_mutator(mod)``, a PyExprMutator; the PrimFuncs its builder added stay in the module."""

    @tvm.transform.module_pass(opt_level=0, name=pass_name)
    def run(mod, _ctx):
        rewriter = make_mutator(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()

    return run


def main_pass(name: str):
    """Decorate fn(mod, main) -> new body (or None: unchanged) as a module pass "tvmdm.<name>" rewriting
    ``main`` (a module without one passes through)."""

    def wrap(fn):
        @tvm.transform.module_pass(opt_level=0, name=f"tvmdm.{name}")
        def run(mod, _ctx):
            if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
                return mod
            func = mod["main"]
            body = fn(mod, func)
            if body is None:
                return mod
            out = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)
            out["main"] = relax.Function(func.params, body, func.ret_ty, attrs=func.attrs)
            return out

        run.__doc__ = fn.__doc__
        return run

    return wrap


def rewritten(mod: tvm.IRModule, name: str, mutator) -> tvm.IRModule:
    """``mod`` with function ``name`` visited by ``mutator`` (a PyExprMutator made on ``mod``), plus the
    PrimFuncs the mutator added to its builder."""
    func = mod[name]
    body = mutator.visit_expr(func).body
    out = tvm.IRModule(dict(mutator.builder_.get().functions.items()), attrs=mod.attrs)
    out[name] = relax.Function(func.params, body, func.ret_ty, attrs=func.attrs)
    return out


def has_block(func: tirx.PrimFunc, name: str) -> bool:
    """Whether PrimFunc ``func`` has a block named ``name``."""
    try:
        Schedule(func).get_sblock(name)
        return True
    except Exception:  # noqa: BLE001 - get_sblock raises when there is no such block
        return False


def op_name(prim_func_name: str) -> str:
    """LegalizeOps names a PrimFunc after its op, numbered when shapes differ: "add3" -> "add"."""
    return re.sub(r"\d+$", "", prim_func_name)


def primitive_call(builder, name: str, args: list, body) -> relax.Call:
    """A Primitive function ``name`` added to ``builder``'s module, over ``args`` (main's values), and the call of
    it on them: FuseTIR then makes the kernels its body calls one kernel. ``body(fb, inner)`` emits the body's
    call_tirs with ``fb`` on ``inner(arg)`` (the function's side of an arg) and returns its output. Post-FuseTIR,
    a kernel's symbolic dims are PrimType arguments: they reach the function as one Shape parameter, which
    defines them there. An arg given twice (Q, K and V as views of one packed tensor) is one parameter."""
    unique = []
    for arg in args:
        if not any(arg.same_as(u) for u in unique):
            unique.append(arg)
    tensors = [a for a in unique if not isinstance(a.ty, tvm.ir.PrimType)]
    scalars = [a for a in unique if isinstance(a.ty, tvm.ir.PrimType)]
    params = {a: relax.Var(f"arg{i}", a.ty) for i, a in enumerate(tensors)}
    shape_param = [relax.Var("tir_vars", relax.ShapeType(scalars))] if scalars else []
    fb = relax.BlockBuilder()
    with fb.function(name, list(params.values()) + shape_param, {"Primitive": True}):
        with fb.dataflow():
            out = fb.emit_output(body(fb, lambda a: params.get(a, a)))
        fb.emit_func_output(out)
    gv = builder.add_func(fb.get()[name], name)
    return relax.Call(gv, tensors + ([relax.ShapeExpr(scalars)] if scalars else []))


def merging_pass(pass_name: str, rewrite_function, provenance: dict | None) -> tvm.transform.Pass:
    """A post-FuseTIR module pass: ``rewrite_function(mod, name, provenance) -> (mod, changed)`` on every Relax
    function that is not Primitive (it calls primitive_call for the kernels it merges), then FuseTIR makes each
    merged function one kernel. ``provenance`` (fusion's kernel -> ops record), if given, learns their ops."""

    @tvm.transform.module_pass(opt_level=0, name=pass_name)
    def run(mod, _ctx):
        merged = False
        for gv, func in list(mod.functions_items()):
            if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs):
                mod, changed = rewrite_function(mod, gv.name_hint, provenance if provenance is not None else {})
                merged = merged or changed
        if not merged:
            return mod
        return relax.transform.DeadCodeElimination()(relax.transform.FuseTIR()(mod))

    return run
