"""make_options: the API's arguments -> one ``Options`` (target made, tuning logs resolved, packing chosen)."""
from __future__ import annotations

import os
import warnings

import tvm

from tvmdm.core.options import DEFAULT_FUSION, DEFAULT_LAYOUT, Options
from tvmdm.core.target import attention_on_matrix_units, make_target
from schedules.database import TuningLogWarning


def resolve_logs(tuning_logs, target):
    """"shipped" -> the shipped logs tuned for ``target`` (a list, maybe empty); anything else as given."""
    from schedules.logs import shipped_logs

    return shipped_logs(target) if isinstance(tuning_logs, str) and tuning_logs == "shipped" else tuning_logs


def packed_lanes(tuning_logs, target, precision: str, symbolic: bool = False, rows: int | None = None) -> int | None:
    """The weight panel width for schedules.packed when the fp32 contractions have no records tuned on this CPU
    model at this size: no log suits it, the logs were tuned on another model (schedules.logs.tuned_on_this_cpu;
    their records still serve the other kernels) or at other (batch x seq) ``rows`` (schedules.logs.
    tuned_for_rows), or the module has symbolic (batch, seq) dims (records are for static shapes only: a
    symbolic module would fall to the default schedules, ~9x slower on BERT-base). An explicit
    ``tuning_logs=None`` keeps the plain default schedules, a user's log directory (no meta.json) its own
    records."""
    from schedules.logs import tuned_for_rows, tuned_on_this_cpu
    from schedules.packed import panel_lanes

    if target.kind.name != "llvm" or precision != "fp32" or not isinstance(tuning_logs, list):
        return None
    if not symbolic and any(tuned_on_this_cpu(logs_dir, target) and tuned_for_rows(logs_dir, rows)
                            for logs_dir in tuning_logs):
        return None
    return panel_lanes(target)


def make_options(target="llvm", *, fusion: str = DEFAULT_FUSION, layout: str = DEFAULT_LAYOUT,
                 precision: str = "fp32", tuning_logs="shipped", symbolic: bool = False,
                 training: bool = False, rows: int | None = None) -> Options:
    """``tuning_logs``: "shipped" (the shipped logs tuned for this target), a directory, a list of them, or None.
    ``symbolic``: the module has symbolic (batch, seq) dims (no record serves it). ``rows``: its batch x seq
    (records tuned at another size do not serve its contractions)."""
    from schedules.logs import logs_for_target

    tvm_target = target if isinstance(target, tvm.target.Target) else make_target(target)
    shipped = isinstance(tuning_logs, str) and tuning_logs == "shipped"
    if symbolic and tuning_logs is not None and not shipped:
        warnings.warn(f"tuning logs {tuning_logs!r} not read: records are for static shapes, and this module keeps "
                      "symbolic dims (bind them: shapes=... or --batch/--seq)", TuningLogWarning, stacklevel=3)
    # a symbolic module matches no record: nothing is read (MBs of logs parsed for nothing)
    logs = resolve_logs(tuning_logs, tvm_target) if not symbolic or tuning_logs is None else []
    if logs and not shipped:
        # the user's logs: one labelled for another target is left out (with a warning); a single directory
        # that stays keeps its form (packed_lanes reads a list as logs to weigh, a directory as the user's own)
        single = isinstance(logs, (str, os.PathLike))
        kept = logs_for_target([logs] if single else list(logs), tvm_target)
        if not (single and kept):
            logs = kept
    lanes = packed_lanes(logs, tvm_target, precision, symbolic=symbolic, rows=rows)
    dirs = [logs] if isinstance(logs, (str, os.PathLike)) else list(logs or [])
    # CPU inference: the attention in one tile kernel (tvmdm.transform.tile_attention) instead of batched matmuls
    batched = attention_on_matrix_units(tvm_target, precision) and not (tvm_target.kind.name == "llvm" and not training)
    return Options(tvm_target, fusion=fusion, layout=layout, precision=precision, training=training,
                   tuning_logs=tuple(os.fspath(d) for d in dirs), packed_lanes=lanes, batched_attention=batched)
