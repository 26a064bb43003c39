"""Which outputs of a compiled module the runner must copy before handing them to the caller.

The runner hands a CPU module's outputs to the caller as numpy views of the memory the call allocated, not as
copies (a BERT layer's (8, 128) output: 3 MB, 0.3-0.4 ms a call). That is safe for an output the call made: a
kernel's result, or a view of one (reshape, squeeze, expand_dims and flatten are views in the VM), whose memory
nothing else holds once the call returns. It is not for an output that is a parameter (an input, which may be
the caller's own array; a weight the module keeps), a constant (the module's constant pool) or a view of one,
nor for an output repeated (two outputs, one memory): those are copied.
"""
from __future__ import annotations

import tvm
from tvm import relax

from tvmdm.transform.ir import bindings_of, call_op

VIEWS = ("relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten")


def _made_by_the_call(expr, values: dict) -> bool:
    """Whether ``expr`` (an output of main, or a tuple field) is memory main's call allocated."""
    while True:
        if isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        elif call_op(expr) in VIEWS:
            expr = expr.args[0]
        elif isinstance(expr, relax.TupleGetItem):
            tuple_value = expr.tuple_value
            while isinstance(tuple_value, relax.Var) and tuple_value in values:
                tuple_value = values[tuple_value]
            if isinstance(tuple_value, relax.Tuple):
                expr = tuple_value.fields[expr.index]
            else:
                return isinstance(tuple_value, relax.Call) and call_op(tuple_value) != "relax.call_pure_packed"
        else:
            # an operator or a kernel computed it; a packed call (a view the VM makes) or anything else may not
            return isinstance(expr, relax.Call) and call_op(expr) != "relax.call_pure_packed"


def outputs_to_copy(mod: tvm.IRModule) -> list[int]:
    """The indices of ``mod``'s main outputs (a tuple's fields, or the one output: index 0) that are not memory
    its call made, or that repeat an earlier output."""
    func = mod["main"]
    values = bindings_of(func)
    body = func.body.body if isinstance(func.body, relax.SeqExpr) else func.body
    while isinstance(body, relax.Var) and body in values and isinstance(values[body], relax.Tuple):
        body = values[body]
    outputs = list(body.fields) if isinstance(body, relax.Tuple) else [body]
    seen, copied = set(), []
    for index, output in enumerate(outputs):
        if output in seen or not _made_by_the_call(output, values):
            copied.append(index)
        seen.add(output)
    return copied
