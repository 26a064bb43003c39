"""Inputs as users hold them -> host arrays the runner checks; host arrays -> device tensors without a copy
where the memory allows.

Accepted, as onnxruntime's ``InferenceSession.run`` accepts them and more: any mapping of input name -> value
(a dict, a tokenizer's ``BatchEncoding``), each value a numpy array, a torch tensor, any object exporting
DLPack (``__dlpack__``), or nested lists of numbers (a tokenizer called without ``return_tensors``).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tvm

from tvmdm.core.errors import InputError

DLPACK_CPU = 1  # DLDeviceType kDLCPU


def as_mapping(inputs) -> Mapping:
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a mapping of input name -> array (a dict, a tokenizer's BatchEncoding), "
                         f"got {type(inputs).__name__}")
    return inputs


def host_array(name: str, value) -> np.ndarray:
    """A numpy view of ``value`` (no copy for numpy, torch CPU tensors and CPU DLPack exporters)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        if hasattr(value, "detach"):  # a torch tensor that requires grad refuses to export itself
            value = value.detach()
        device = value.__dlpack_device__()[0] if hasattr(value, "__dlpack_device__") else DLPACK_CPU
        if device != DLPACK_CPU:
            if not hasattr(value, "cpu"):
                raise InputError(f"input {name!r} lives on a device (DLPack device type {device}): pass it in "
                                 "host memory")
            value = value.cpu()  # a torch CUDA tensor: the ids and masks of a batch, a few KB
        try:
            return np.from_dlpack(value)
        except (TypeError, BufferError, RuntimeError) as err:
            raise InputError(f"input {name!r}: cannot read {type(value).__name__} through DLPack ({err})") from None
    if isinstance(value, (list, tuple, int, float, np.generic)):
        return np.asarray(value)  # Python ints become int64, the dtype BERT exports take
    raise InputError(f"input {name!r} must be a numpy array, a torch tensor, a DLPack exporter or a list, got "
                     f"{type(value).__name__}")


TVM_ALIGNMENT = 64  # bytes: the alignment TVM's from_dlpack requires of a tensor it shares


def device_tensor(array: np.ndarray, device) -> "tvm.runtime.Tensor":
    """``array`` on ``device``: shared, not copied, on the CPU when it is contiguous and 64-byte aligned (what
    TVM's kernels assume); a copy otherwise."""
    if device.dlpack_device_type() == DLPACK_CPU and array.flags.c_contiguous and array.size and \
            array.ctypes.data % TVM_ALIGNMENT == 0:  # checked first: TVM's refusal costs ~20 us a call
        try:
            return tvm.runtime.from_dlpack(array)
        except (RuntimeError, TypeError, BufferError):  # refused all the same: copied below
            pass
    return tvm.runtime.tensor(array, device)
