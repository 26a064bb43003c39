"""The MetaSchedule workarounds of tvmdm.tune.metaschedule_fixes."""
import pytest

from tvmdm.tune import metaschedule_fixes


def test_metaschedule_logging_survives_foreign_handlers(tmp_path):
    import logging

    from tvm.s_tir.meta_schedule.logging import get_loggers_from_work_dir

    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    logger.addHandler(logging.NullHandler())  # unnamed, as a harness or another library may leave one
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'format'"):
        get_loggers_from_work_dir(str(tmp_path), ["task"])
    metaschedule_fixes.reset_metaschedule_logging()
    assert get_loggers_from_work_dir(str(tmp_path), ["task"])
    metaschedule_fixes.reset_metaschedule_logging()
