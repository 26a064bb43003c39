"""Per-kernel measurement: which TIR kernels a compiled module calls, how often, their flops and their time.

TVM 0.27's Relax VM has no per-call profiler, so each kernel (with static shapes) is built alone and timed
with TVM's time evaluator on random inputs, as MetaSchedule measures candidates; a kernel's share is its time
times its number of call sites. Alone, a kernel's operands stay in the caches between repeats; in a training
step on 2 Sapphire Rapids cores the same kernels took 1.5-3x longer, their operands coming from DRAM.
``profile_in_place`` times each call where it runs instead (the VM's instrument hook around every call).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax, tirx
from schedules.rule import FLOPS_ATTR


@dataclasses.dataclass
class KernelProfile:
    name: str
    calls: int
    flops: int  # per call
    seconds: float | None  # per call, median; None when not measured (symbolic shapes)

    @property
    def is_contraction(self) -> bool:
        return any(word in self.name for word in ("matmul", "dense", "einsum", "gemm"))

    @property
    def gflops_per_s(self) -> float | None:
        return self.flops / self.seconds / 1e9 if self.seconds else None


def call_sites(mod: tvm.IRModule, entry: str = "main") -> dict[str, int]:
    """Kernel name -> number of call_tir sites in ``entry`` (not of functions: one kernel can run twice)."""
    counts: dict[str, int] = {}
    call_tir = tvm.ir.Op.get("relax.call_tir")

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            name = expr.args[0].name_hint
            counts[name] = counts.get(name, 0) + 1

    relax.analysis.post_order_visit(mod[entry].body, visit)
    return counts




def kernel_flops(mod: tvm.IRModule, name: str, call=None) -> int:
    """Flops of one call: the rule's count (FLOPS_ATTR), the attention's tile kernel's from the queries of
    ``call`` (its signature is symbolic: 2 contractions of 2 B H L^2 D each), else TVM's estimate."""
    from tvm.s_tir.analysis import estimate_tir_flops
    from tvmdm.transform.tile_attention import TILE_ATTENTION_ATTR

    func = mod[name]
    if func.attrs and FLOPS_ATTR in func.attrs:
        return int(func.attrs[FLOPS_ATTR])
    if func.attrs and TILE_ATTENTION_ATTR in func.attrs and call is not None:
        batch, heads, length, dim = (int(d) for d in call.args[1].fields[0].ty.shape.values)
        return 4 * batch * heads * length * length * dim
    return int(estimate_tir_flops(tvm.IRModule({name: func})))


def call_arg_types(call) -> list:
    """The arguments a call_tir passes its kernel, outputs included: a tensor type each, or a scalar's value."""
    out = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else [call.ty]
    return [int(arg) if isinstance(arg.ty, tvm.ir.PrimType) else arg.ty for arg in call.args[1].fields] + out


def _random_args(func, device, arg_types=None):
    """Random arguments for ``func``: from its own (static) buffer shapes, or from ``arg_types`` (call_arg_types
    of a call of it, static: a kernel of symbolic signature called with concrete tensors and scalars)."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    rng = np.random.default_rng(0)
    if arg_types is None:
        specs = [([int(d) for d in info.shape], str(info.dtype)) for info in ArgInfo.from_prim_func(func)]
    else:
        specs = [ty if isinstance(ty, int) else ([int(d) for d in ty.shape.values], str(ty.dtype))
                 for ty in arg_types]
    args = []
    for spec in specs:
        if isinstance(spec, int):  # a scalar passed by value
            args.append(spec)
            continue
        shape, dtype = spec
        if dtype.startswith(("int", "uint")):
            value = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            value = rng.standard_normal(shape).astype(dtype)
        args.append(tvm.runtime.tensor(value, device))
    return args


def time_kernel(func: tirx.PrimFunc, target, repeat: int = 5, min_repeat_ms: int = 20, arg_types=None) -> float:
    """Median seconds of one call of ``func`` built alone for ``target``. A kernel on the AMX tiles asks for the
    process's tile state first, as a module that uses them does when it loads (else SIGILL when nothing in the
    process has run such a module yet). ``arg_types``: call_arg_types of a call of it (see _random_args)."""
    from schedules.amx import uses_amx
    from tvmdm.runtime import amx

    device = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    amx.prepare(uses_amx(mod))
    lib = tvm.compile(mod, target=target)
    args = _random_args(func, device, arg_types)
    timer = lib.jit().time_evaluator("main", device, number=1, repeat=repeat, min_repeat_ms=min_repeat_ms)
    return float(np.median(timer(*args).results))


def _static(func: tirx.PrimFunc) -> bool:
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    return all(isinstance(d, (int, tirx.IntImm)) for info in ArgInfo.from_prim_func(func) for d in info.shape)


def profile_kernels(mod: tvm.IRModule, target, measure: bool = True, repeat: int = 5,
                    entry: str = "main") -> list[KernelProfile]:
    """One row per kernel that ``entry`` calls, most time first (measured when shapes are static)."""
    rows = []
    for name, calls in call_sites(mod, entry).items():
        func = mod[name]
        seconds = time_kernel(func, target, repeat) if measure and _static(func) else None
        rows.append(KernelProfile(name, calls, kernel_flops(mod, name), seconds))
    rows.sort(key=lambda r: -(r.seconds or 0) * r.calls)
    return rows


def profile_in_place(runner, run, repeat: int = 5) -> list[KernelProfile]:
    """Each kernel timed where the module runs it: ``run()`` (e.g. ``lambda: compiled.run(feeds)``, or a training
    step's ``step``) called ``repeat`` times with the Relax VM's instrument hook timing every call of
    ``runner`` (the Compiled or TrainStep whose module ``run`` calls). One row per kernel, most time first:
    its calls per run and seconds per call (the median over the runs of each call's mean); flops are not
    counted (0). The hook's own cost (~1 us a call) is inside the times."""
    import time

    runner._ensure_loaded()
    vm = runner._vm
    per_run: list[dict[str, list[float]]] = []
    started = [0.0]

    def instrument(_func, symbol, before, _ret, *_args):
        if before:
            started[0] = time.perf_counter()
        else:
            per_run[-1].setdefault(symbol, []).append(time.perf_counter() - started[0])
        return 0

    run()  # warm-up, not timed
    vm.set_instrument(instrument)
    try:
        for _ in range(repeat):
            per_run.append({})
            run()
    finally:
        vm.set_instrument(None)
    kernels = {name for calls in per_run for name in calls if not name.startswith("vm.builtin.")}
    rows = [KernelProfile(name, len(per_run[0].get(name, [])), 0,
                          float(np.median([np.mean(calls[name]) for calls in per_run if name in calls])))
            for name in kernels]
    rows.sort(key=lambda r: -(r.seconds or 0) * r.calls)
    return rows


def gemm_peak_gflops(n: int = 2048, repeat: int = 5) -> float:
    """This machine's fp32 GEMM peak as numpy's BLAS reaches it (all threads): the yardstick for contractions."""
    import time

    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    a @ b
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / float(np.median(times)) / 1e9
