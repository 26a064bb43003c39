"""The schedule stage: one pass applying the rules in one declared order.

Each rule schedules the kernels it knows and returns nothing for the others; a kernel goes to the first rule
that takes it. The order says which schedule wins where several could:

  1-2  column reductions, transposes: by hand; MetaSchedule's CPU space finds nothing as good;
  3-7  packed fp32, int8 and bf16 contractions: the kernels the precision and quantization rewrites made for
       our micro-kernels (int8 on vpdpbusd; bf16 on the AMX tiles where the CPU has them and the shape fills
       whole tiles, else AVX512-BF16), and the attention's one tile kernel (tvmdm.transform.tile_attention);
  8-9  the paper's attention kernels and row-wise normalizations, by hand: on 2 Zen 4 cores (AVX-512) the
       shipped Zen 4 records of SM and BDRLN take 5.6 and 0.39 ms at (8, 128) against 1.67 and 0.13 by hand (on
       a Sapphire Rapids VM 5.5 against 1.5 ms for SM), so no record replaces them and they are not tuned;
  10-11 tuning records: the first applies when they were tuned on this CPU model (``Options.records_first``),
       the second otherwise (the same records; kept apart so that a rule can go between them);
  12   the default schedule, for every kernel left.
"""
from __future__ import annotations

import warnings

import tvm
from tvm import tirx

from schedules.amx import AmxContractions
from schedules.amx_attention import TileAttention
from schedules.attention import AttentionKernels
from schedules.bf16 import Bf16Contractions
from schedules.default import DefaultSchedule
from schedules.int8 import Int8Contractions
from schedules.logs import TuningRecords
from schedules.packed import PackedContractions
from schedules.reductions import ColumnReductions
from schedules.rows import RowNormalizations
from schedules.rule import RULE_ATTR, is_scheduled, kernels_by
from schedules.transposes import Transposes

SCHEDULE_RULES = (
    ColumnReductions(),
    Transposes(),
    PackedContractions(),
    Int8Contractions(),
    AmxContractions(),
    TileAttention(),
    Bf16Contractions(),
    AttentionKernels(),
    RowNormalizations(),
    TuningRecords(first=True),
    TuningRecords(first=False),
    DefaultSchedule(),
)


def taken_by_hand(func: tirx.PrimFunc, options) -> bool:
    """Whether a hand-written rule ahead of the tuning records takes ``func`` (the tuner leaves it out: no
    record of it would be applied)."""
    kernel = {tvm.ir.GlobalVar("main"): func}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the rules' warnings (no AVX512-BF16, ...) are for compile to give
        for rule in SCHEDULE_RULES:
            if isinstance(rule, TuningRecords):
                return False
            if rule.hand_written and rule.apply(kernel, options):
                return True
    return False


def apply_schedules(options, rules=SCHEDULE_RULES) -> tvm.transform.Pass:
    """Module pass: every unscheduled kernel of the module to the first of ``rules`` that takes it; each
    scheduled kernel carries the name of its rule (``RULE_ATTR``)."""

    @tvm.transform.module_pass(opt_level=0, name="tvmdm.ApplySchedules")
    def run(mod, _ctx):
        mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for rule in rules:
            todo = {gv: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and not is_scheduled(f)}
            if not todo:
                break
            for gv, func in rule.apply(todo, options).items():
                mod[gv] = func.with_attr(RULE_ATTR, rule.name)
        return mod

    return run


def tuned_kernels(mod: tvm.IRModule) -> list[str]:
    """The kernels a tuning record scheduled."""
    return kernels_by(mod, hand_written=False, rules=[r for r in SCHEDULE_RULES if isinstance(r, TuningRecords)])


def hand_kernels(mod: tvm.IRModule) -> list[str]:
    """The kernels a hand-written rule scheduled."""
    return kernels_by(mod, hand_written=True, rules=SCHEDULE_RULES)


def scheduled_by(mod: tvm.IRModule, rule) -> list[str]:
    """The kernels ``rule`` (a ScheduleRule) scheduled."""
    return sorted(gv.name_hint for gv, f in mod.functions_items()
                  if isinstance(f, tirx.PrimFunc) and f.attrs and str(f.attrs.get(RULE_ATTR, "")) == rule.name)
