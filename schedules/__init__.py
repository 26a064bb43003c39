"""Schedules for the fused kernels: default rules now; MetaSchedule tuning and shipped logs build on this."""
from schedules.default import apply_default_schedules

__all__ = ["apply_default_schedules"]
