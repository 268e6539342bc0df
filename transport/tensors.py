"""Tensors as raw bytes: their description on the wire, byte views to send, buffers to receive.

No I/O here. A tensor crosses the wire as its raw bytes (one C-contiguous buffer) plus a
``TensorSpec`` (dtype name and shape) in the header. The byte views keep device memory on the
device, so UCX moves it GPU-to-GPU; nothing here copies.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

from infinite_llm.transport.messages import WireArray

# dtype name -> bytes per element. Names follow numpy/torch ("bfloat16" exists only in torch).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # a key of DTYPE_ITEMSIZE
    shape: tuple[int, ...]  # elements per dimension

    @functools.cached_property
    def nbytes(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype] * math.prod(self.shape)


TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _TORCH_DTYPES.items()}


def dtype_name(dtype: object) -> str:
    """The wire name of a numpy, cupy or torch dtype."""
    name = TORCH_DTYPE_NAMES.get(dtype) if isinstance(dtype, torch.dtype) else None
    return name or getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")


def spec_of(array: WireArray) -> TensorSpec:
    name = dtype_name(array.dtype)
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype {name} cannot travel on the wire")
    return TensorSpec(dtype=name, shape=tuple(int(d) for d in array.shape))


def is_cuda(array: WireArray) -> bool:
    if isinstance(array, torch.Tensor):  # first: a CPU tensor's interface check raises inside
        return array.is_cuda
    return hasattr(array, "__cuda_array_interface__")


def wire_view(array: WireArray) -> object:
    """A flat uint8 view of ``array``'s memory that UCX can send from or receive into.

    Host memory becomes a numpy array, device memory keeps ``__cuda_array_interface__`` (torch
    or cupy), so UCX sees the device pointer. Raises ValueError for a non-contiguous array: the
    transport never makes a hidden copy.
    """
    if isinstance(array, torch.Tensor):
        if not array.is_contiguous():
            raise ValueError("tensor must be contiguous")
        # bfloat16 has no array-interface type string; a byte view sidesteps that.
        flat = array.reshape(-1).view(torch.uint8)
        return flat if array.is_cuda else flat.numpy()
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("array must be C-contiguous")
        return array.reshape(-1).view(np.uint8)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(array, cupy.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("array must be C-contiguous")
        return array.reshape(-1).view(cupy.uint8)
    raise TypeError(f"cannot send a {type(array).__name__}")


def wait_for_producers(device_arrays: list[WireArray]) -> None:
    """Wait until the kernels queued to write these device arrays are done: the current torch
    stream of each array's device. (A cupy array made on a stream of its own is its producer's
    to synchronise.)"""
    devices = {array.device.index if isinstance(array, torch.Tensor) else torch.cuda.current_device()
               for array in device_arrays}
    for index in devices:
        torch.cuda.current_stream(index).synchronize()


def nbytes_of(array: WireArray) -> int:
    if isinstance(array, torch.Tensor):
        return array.numel() * array.element_size()
    return int(array.nbytes)


def allocate(spec: TensorSpec, device: str) -> torch.Tensor:
    """An uninitialised torch tensor for ``spec`` on ``device`` ("cpu" or "cuda[:n]")."""
    return torch.empty(spec.shape, dtype=_TORCH_DTYPES[spec.dtype], device=device)


def host_tensor_from_bytes(spec: TensorSpec, data: bytes | memoryview | bytearray, offset: int = 0) -> torch.Tensor:
    """A host tensor for ``spec`` from ``spec.nbytes`` bytes of ``data`` at ``offset``: a view
    of ``data`` where it is a bytearray (writable memory the caller hands over), else of a copy
    of those bytes; in two torch calls."""
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=_TORCH_DTYPES[spec.dtype])
    if not isinstance(data, bytearray):
        data, offset = bytearray(data[offset:offset + spec.nbytes]), 0
    dtype = _TORCH_DTYPES[spec.dtype]
    flat = torch.frombuffer(data, dtype=dtype, count=spec.nbytes // DTYPE_ITEMSIZE[spec.dtype], offset=offset)
    shape = spec.shape
    # Shaped only where it has to be, and with the sizes as arguments: a view given a tuple
    # costs torch's argument parser about a microsecond more, on every small frame's tensors.
    if len(shape) == 1:
        return flat
    return flat.view(*shape) if shape else flat.view(shape)


def copy_bytes(dst: WireArray, src: WireArray) -> None:
    """Copy the raw bytes of ``src`` into ``dst`` (same byte count): the in-memory wire."""
    dst_bytes = _as_torch_bytes(dst)
    dst_bytes.copy_(_as_torch_bytes(src))


def _as_torch_bytes(array: WireArray) -> torch.Tensor:
    view = wire_view(array)
    if isinstance(view, torch.Tensor):
        return view
    if isinstance(view, np.ndarray):
        return torch.from_numpy(view)
    return torch.as_tensor(view, device="cuda")  # cupy, through __cuda_array_interface__
