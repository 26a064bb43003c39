"""Which outputs of a compiled module the runner must copy before handing them to the caller.

The runner hands a CPU module's outputs to the caller as numpy views of the memory the call allocated, not as
copies (a BERT layer's (8, 128) output: 3 MB, 0.3-0.4 ms a call). That is safe for an output the call made: a
kernel's result, or a view of one (reshape, squeeze, expand_dims and flatten are views in the VM), whose memory
nothing else holds once the call returns. It is not for an output that is a parameter (an input, which may be
the caller's own array; a weight the module keeps), a constant (the module's constant pool) or a view of one,
nor for an output whose memory an earlier output already has (a repeat, or a view of it): those are copied.
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.transform.ir import bindings_of, call_op

VIEWS = ("relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten")


def _memory_of(expr, values: dict):
    """What made the memory ``expr`` (an output of main) lives in: a call (with the field, for a call of
    several results), a parameter, a constant, ... Views are followed to what they view."""
    field = None
    while True:
        if isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        elif call_op(expr) in VIEWS:
            expr = expr.args[0]
        elif isinstance(expr, relax.TupleGetItem) and field is None:
            expr, field = expr.tuple_value, expr.index
        elif isinstance(expr, relax.Tuple) and field is not None:
            expr, field = expr.fields[field], None
        else:
            return expr, field


def outputs_to_copy(mod: tvm.IRModule) -> list[int]:
    """The indices of ``mod``'s main outputs (a tuple's fields, or the one output: index 0) whose memory its
    call did not make, or that an earlier output already hands over."""
    func = mod["main"]
    values = bindings_of(func)
    body = func.body.body if isinstance(func.body, relax.SeqExpr) else func.body
    while isinstance(body, relax.Var) and body in values and isinstance(values[body], relax.Tuple):
        body = values[body]
    outputs = list(body.fields) if isinstance(body, relax.Tuple) else [body]
    handed_over, copied = [], []
    for index, output in enumerate(outputs):
        maker, field = _memory_of(output, values)
        # an operator or a kernel computed it; a packed call (a view the VM makes) or anything else may not
        made = isinstance(maker, relax.Call) and call_op(maker) != "relax.call_pure_packed"
        if not made or any(maker.same_as(m) and field == f for m, f in handed_over):
            copied.append(index)
        else:
            handed_over.append((maker, field))
    return copied
