"""Tuning: MetaSchedule on a model's fused kernels, records appended to a log as they are measured."""
