"""What a schedule rule is, and the helpers rules share.

A rule (as dlight's ``ScheduleRule``) schedules the kernels it knows and returns nothing for the others;
``schedules.pipeline`` applies the rules in one declared order, each to the kernels no earlier rule took.
"""
from __future__ import annotations

import logging

import tvm
from tvm import tirx
from tvm.s_tir import schedule as sch_mod

log = logging.getLogger("tvmdm")
# What TVM raises where a schedule primitive does not fit a loop nest (ScheduleError and InternalError are
# RuntimeErrors; bad indices and arguments come through the FFI as IndexError / ValueError).
DOES_NOT_FIT = (RuntimeError, ValueError, IndexError)
RULE_ATTR = "tvmdm.schedule_rule"  # the rule that scheduled a kernel (reports: tuned vs hand-written)
FLOPS_ATTR = "tvmdm.flops"  # set by rules that tensorize (estimate_tir_flops cannot read vector intrinsics)


class ScheduleRule:
    """``schedule(func, options)`` returns the scheduled kernel, or None where the rule does not apply.
    ``hand_written``: the rule's kernels count as scheduled by hand (``Compiled.hand_kernels``)."""

    name = "rule"
    hand_written = True

    def schedule(self, func: tirx.PrimFunc, options) -> tirx.PrimFunc | None:
        raise NotImplementedError

    def apply(self, kernels: dict, options) -> dict:
        """{GlobalVar: kernel} -> {GlobalVar: scheduled kernel} for those the rule takes. A loop nest a rule
        cannot transform (TVM raises a ScheduleError) is left to the next rule."""
        done = {}
        for gv, func in kernels.items():
            try:
                scheduled = self.schedule(func.with_attr("global_symbol", gv.name_hint), options)
            except DOES_NOT_FIT as err:
                log.debug("%s: schedule rule %s does not fit, left to the next rule: %s", gv.name_hint, self.name,
                          str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
                scheduled = None
            if scheduled is not None:
                done[gv] = scheduled
        return done


def is_scheduled(func) -> bool:
    return isinstance(func, tirx.PrimFunc) and bool(func.attrs and func.attrs.get("tirx.is_scheduled", False))


def finds_block(func: tirx.PrimFunc, finder) -> bool:
    """Whether a hand-schedule rule's ``finder(schedule) -> block or None`` takes ``func`` (tuning leaves such
    kernels out)."""
    try:
        return finder(sch_mod.Schedule(func)) is not None
    except DOES_NOT_FIT:  # no block tree (hand-written kernels) or a form the rule does not read
        return False


def kernels(mod: tvm.IRModule) -> list[str]:
    return sorted(gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc))


def kernels_by(mod: tvm.IRModule, hand_written: bool, rules) -> list[str]:
    """The kernels of ``mod`` that rules of that kind (among ``rules``) scheduled."""
    names = {r.name for r in rules if r.hand_written == hand_written}
    return sorted(gv.name_hint for gv, f in mod.functions.items()
                  if isinstance(f, tirx.PrimFunc) and f.attrs and str(f.attrs.get(RULE_ATTR, "")) in names)
