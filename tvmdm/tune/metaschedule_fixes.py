"""Workarounds for TVM 0.27's MetaSchedule and TVMScript parser that the tuner needs; regression tests in
tests/tune/test_metaschedule_fixes.py."""
from __future__ import annotations


_TVMSCRIPT_ENTRIES = ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry")


def _cheap_stack(context: int = 1):
    """inspect.stack() without the source-file lookups: TVMScript only reads frames, locals and the code
    line of its caller's caller (to spot ``@I.ir_module`` classes)."""
    import inspect
    import linecache
    import sys

    frames, frame = [], sys._getframe(1)
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno) if len(frames) < 4 else ""
        frames.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, [line] if line else None,
                                        0 if line else None))
        frame = frame.f_back
    return frames


def speed_up_tvmscript_parsing() -> None:
    """TVMScript's decorators call ``inspect.stack()``, which looks up the source file of every frame; for
    frames of frozen importlib modules that means a scan of sys.modules per frame. Importing
    ``tvm.s_tir.tensor_intrin`` (every MetaSchedule build worker does) then takes 20-50 s instead of ~1 s,
    and most of a tuning trial goes there. Give those modules a stack() that skips the lookups."""
    import importlib
    import inspect
    import types

    proxy = types.ModuleType("inspect")
    proxy.__dict__.update(inspect.__dict__)
    proxy.stack = _cheap_stack
    for name in _TVMSCRIPT_ENTRIES:
        importlib.import_module(name).inspect = proxy


def reset_metaschedule_logging() -> None:
    """MetaSchedule's logging setup lists the names of the handlers already on its logger; a handler without
    a name (one added by another library or a test harness, or left by a previous tuning run in the same
    process) makes it fail with "'NoneType' object has no attribute 'format'". It re-creates its own
    handlers, so clear them before each tuning run.

    Its console handler (on stdout, where results go) takes this logger's level: WARNING keeps its INFO lines
    in its log files (<logs>/logs/) unless tvmdm's debug log is on (``tvmdm -v``, TVMDM_VERBOSE=1)."""
    import logging

    from tvmdm.core import native_log

    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    chatty = native_log.verbose() or logging.getLogger("tvmdm").isEnabledFor(logging.DEBUG)
    logger.setLevel(logging.INFO if chatty else logging.WARNING)
