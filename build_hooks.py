"""Build step for the wheel (pyproject's cmdclass): the shipped tuning logs go in pruned to what a compile applies.
Not part of the installed package."""
import os
import sys

from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schedules.log_lines import WORKLOADS, prune_directory  # noqa: E402  (standard library only: no TVM at build time)

LOGS = "tuning_logs"


class BuildPyPruningLogs(build_py):
    """build_py, then each shipped log directory in the build tree replaced by its pruned form."""

    def run(self):
        super().run()
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), LOGS)
        for name in sorted(os.listdir(source)):
            if os.path.isfile(os.path.join(source, name, WORKLOADS)):
                read, kept = prune_directory(os.path.join(source, name), os.path.join(self.build_lib, LOGS, name))
                self.announce(f"tuning_logs/{name}: {kept} of {read} records (the best of each kernel)", 2)
