"""Timing one system until its median is stable, and checking its outputs against onnxruntime's first: what
every benchmark (in this process or in one of its own, tvmdm.bench.isolated) measures with."""
from __future__ import annotations

import time

import numpy as np


def time_until_stable(fn, *, warmup: int = 2, min_runs: int = 5, max_runs: int = 100, max_seconds: float = 30.0,
                      rel_tol: float = 0.02) -> list[float]:
    """Seconds per call: rounds of ``min_runs`` calls until one more round moves the median by < ``rel_tol``
    (or ``max_runs`` / ``max_seconds`` is reached)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    previous = None
    while True:
        for _ in range(min_runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        median = float(np.median(times))
        if previous is not None and abs(median - previous) <= rel_tol * previous:
            return times
        if len(times) >= max_runs or time.perf_counter() - start > max_seconds:
            return times
        previous = median


def check_agreement(systems: dict, feeds: dict, reference: list, atol: float = 1e-3, rtol: float = 1e-3,
                    relative: dict | None = None, against: str = "onnxruntime") -> dict:
    """Max abs error of every system vs the reference outputs (``against``: whose they are); Disagreement
    naming the first that disagrees. ``relative``: system -> allowed max relative error (max |err| / max |ref|)
    instead of atol/rtol (the reduced-precision systems: tvmdm.core.precision.MAX_REL_ERR)."""
    from tvmdm.build.check import compare_outputs
    from tvmdm.core.errors import Disagreement

    names = [f"output_{i}" for i in range(len(reference))]
    relative = relative or {}
    errors = {}
    for name, run in systems.items():
        check = compare_outputs(names, [np.asarray(o) for o in run(feeds)], reference, atol=atol, rtol=rtol)
        if name in relative:
            bound = relative[name]
            worst = max(o.max_rel_err for o in check.outputs)
            if worst > bound:
                rows = "\n".join(f"  {o.name}: max abs err {o.max_abs_err:.3g}, rel {o.max_rel_err:.3g} "
                                 f"{'ok' if o.max_rel_err <= bound else 'OVER'}" for o in check.outputs)
                raise Disagreement(f"{name} disagrees with {against} before timing: max relative error "
                                   f"{worst:.3g} > {bound:.3g} allowed (relative to each output's largest "
                                   f"value)\n{rows}")
        elif not check.ok:
            raise Disagreement(f"{name} disagrees with {against} before timing:\n{check}")
        errors[name] = check.max_abs_err
    return errors
