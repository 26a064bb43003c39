"""Import TVM's CUDA tensor intrinsics in ~2 s instead of ~26.

dlight's Matmul rule imports ``tvm.s_tir.tensor_intrin.cuda`` the first time it meets a tensor-core shape (an
fp16 contraction), and that module parses a few hundred TVMScript functions. TVM's parser calls
``inspect.stack()`` for each, which reads the source context of every frame: for frames of ``eval``'d code
(no file) that is ``inspect.getmodule``, a walk over every loaded module, ~2000 of them in a compile. That
made the first fp16 compile of a process 30-50 s (the base layer: 33.6 s, of it 26 s in this import).
The parser only needs the frames, not their source lines, so the import runs with a stack that has none.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys

CUDA_INTRINSICS = "tvm.s_tir.tensor_intrin.cuda"


def _frames_without_source(context: int = 1) -> list:
    """``inspect.stack()``'s frames (this one's caller first), without their source lines."""
    frame = sys._getframe(1)
    frames = []
    while frame is not None:
        frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                        None, None))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def _stack_without_source():
    original = inspect.stack
    inspect.stack = _frames_without_source
    try:
        yield
    finally:
        inspect.stack = original


def import_cuda_intrinsics() -> None:
    """Import (once per process) the tensor intrinsics dlight's tensor-core rules use."""
    if CUDA_INTRINSICS in sys.modules:
        return
    with _stack_without_source():
        importlib.import_module(CUDA_INTRINSICS)
