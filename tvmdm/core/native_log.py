"""TVM's C++ log lines (LLVM codegen and TOPI warnings, MetaSchedule's task logs with their TIR) kept off the
user's terminal: ``to_log()`` sends what native code writes to file descriptors 1 and 2 into a file, while
Python's own prints and warnings still reach the terminal.

The lines are then logged at DEBUG on the "tvmdm.tvm" logger (``tvmdm -v`` shows them), and appended to
``log_path`` when one is given (the tuner keeps them beside its records). ``TVMDM_VERBOSE=1`` turns the
redirection off: everything goes where TVM writes it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile

log = logging.getLogger("tvmdm.tvm")
_DEPTH = [0]  # nested uses redirect once


def verbose() -> bool:
    return os.environ.get("TVMDM_VERBOSE", "") not in ("", "0")


def _real_stream(stream, fd: int) -> bool:
    try:
        return stream is not None and stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # pytest's capture, a StringIO: not the file descriptor
        return False


@contextlib.contextmanager
def to_log(log_path: str | None = None):
    if verbose() or _DEPTH[0]:
        _DEPTH[0] += 1
        try:
            yield
        finally:
            _DEPTH[0] -= 1
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    # a named file: were the process to crash inside, TVM's last words stay readable in the temp folder
    sink = tempfile.NamedTemporaryFile(prefix=f"tvmdm-native-{os.getpid()}-", suffix=".log", delete=False)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    swapped = {}
    try:
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            if _real_stream(stream, fd):  # Python keeps writing to the terminal through a copy of the fd
                swapped[name] = stream
                setattr(sys, name, open(os.dup(saved[fd]), "w", buffering=1, encoding=stream.encoding,
                                        errors=stream.errors, closefd=True))
            os.dup2(sink.fileno(), fd)
        _DEPTH[0] += 1
        yield
    finally:
        _DEPTH[0] -= 1
        for name, stream in swapped.items():
            getattr(sys, name).close()
            setattr(sys, name, stream)
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        sink.close()
        _forward(sink.name, log_path)


def _forward(path: str, log_path: str | None) -> None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    finally:
        os.unlink(path)
    if log_path:  # made even when empty: the file says where TVM's lines go
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(text)
    if log.isEnabledFor(logging.DEBUG):
        for line in text.splitlines():
            if line.strip():
                log.debug("%s", line)


class CurrentStderr:
    """A stream that writes to whatever sys.stderr is now: progress created before ``to_log`` (the tuner's)
    keeps reaching the terminal inside it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()
