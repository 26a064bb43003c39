"""Schedules for the fused kernels: tuned records from MetaSchedule logs, default rules for the rest."""
from schedules.apply import apply_tuning_logs, shipped_logs
from schedules.default import apply_default_schedules

__all__ = ["apply_default_schedules", "apply_tuning_logs", "shipped_logs"]
