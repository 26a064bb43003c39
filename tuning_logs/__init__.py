"""The shipped tuning logs: one MetaSchedule JSON database per directory, its meta.json saying for which model,
shapes and target (``schedules.logs.shipped_logs`` picks those that apply). A package so that a wheel carries
them; the wheel's build keeps only what a compile applies (``build_hooks.py``)."""
import os

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
