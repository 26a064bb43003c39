"""The CPU thread count TVM's runtime uses (a TVM 0.27 default that does not suit the VMs we run on)."""
from __future__ import annotations

import os

NUM_THREADS_ENV = "TVM_NUM_THREADS"


def use_all_cores() -> None:
    """TVM's CPU thread pool defaults to half the hardware threads on x86 (it assumes two hyper-threads per core):
    on a 2-core VM without SMT every kernel ran on ONE thread while onnxruntime and torch used two. The pool reads
    TVM_NUM_THREADS when it is first made (lazily, at the first parallel kernel), so default it to the cores this
    process may run on at tvmdm's import. A value the user set is kept."""
    if NUM_THREADS_ENV not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ[NUM_THREADS_ENV] = str(cores)
