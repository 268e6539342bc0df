"""Dequantisation of GGUF tensor data into float32 torch tensors.

Q4_0, Q4_1 and Q8_0 (the types of the small llama.cpp checkpoints) are decoded here in torch,
vectorised over blocks; the k-quants and Q5 types go through the ``gguf`` package's numpy
decoders. Any other type is refused by name, never decoded wrongly.

Block layouts (llama.cpp ``ggml-common.h``), 32 weights per block:
- Q4_0: ``d: f16, qs: u8[16]``; weight ``j`` is ``(nibble_j - 8) * d``.
- Q4_1: ``d: f16, m: f16, qs: u8[16]``; weight ``j`` is ``nibble_j * d + m``.
- Q8_0: ``d: f16, qs: i8[32]``; weight ``j`` is ``qs[j] * d``.
Nibble ``j < 16`` is the low half of ``qs[j]``, nibble ``j >= 16`` the high half of ``qs[j - 16]``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

_QK = 32  # weights per block of Q4_0, Q4_1, Q8_0

# Types decoded by the gguf package's numpy code (slower; correct and tested upstream).
_GGUF_NUMPY_TYPES = frozenset(
    {
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
_TORCH_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
    }
)
SUPPORTED_TYPES = _TORCH_TYPES | _GGUF_NUMPY_TYPES


class UnsupportedQuantization(ValueError):
    """A GGUF tensor is stored in a type this engine does not decode."""


def supported_type_names() -> list[str]:
    return sorted(t.name for t in SUPPORTED_TYPES)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str = "") -> torch.Tensor:
    """Decode one GGUF tensor to float32.

    Args:
        data: the raw tensor data as ``gguf.GGUFReader`` exposes it: a float array for F32/F16
            (BF16 as uint16 or raw uint8 bytes), raw ``uint8`` bytes ``[rows, bytes_per_row]``
            for the block-quantised types.
        qtype: the tensor's GGML type.
        shape: the logical shape, outermost first (``[out_features, in_features]`` for a
            matrix; GGUF lists it innermost first).
        name: the tensor's name, for error messages.

    Returns:
        A float32 tensor of ``shape``.
    """
    if qtype not in SUPPORTED_TYPES:
        type_name = getattr(qtype, "name", str(qtype))
        raise UnsupportedQuantization(
            f"tensor {name!r} is stored as GGML type {type_name}, which this engine cannot dequantise; "
            f"supported: {', '.join(supported_type_names())}"
        )
    numel = int(np.prod(shape))
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(data).view(np.float16)).float().reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        raw = np.ascontiguousarray(data).view(np.uint16).astype(np.int32) << 16
        return torch.from_numpy(raw.view(np.float32)).reshape(shape).clone()
    if qtype in _GGUF_NUMPY_TYPES:
        return torch.from_numpy(gguf_quants.dequantize(np.ascontiguousarray(data), qtype)).float().reshape(shape)

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    num_blocks = numel // block_size
    if numel % block_size or raw.size != num_blocks * type_size:
        raise ValueError(
            f"tensor {name!r}: {raw.size} bytes do not hold {numel} weights of type {qtype.name}"
        )
    # numpy rather than torch for the byte work: torch's uint8 ops on strided views are slow.
    blocks = raw.reshape(num_blocks, type_size)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [num_blocks, 1]
    if qtype == GGMLQuantizationType.Q8_0:
        values = blocks[:, 2:].copy().view(np.int8).astype(np.float32)  # [num_blocks, 32]
        return torch.from_numpy(values * scale).reshape(shape)
    packed = blocks[:, -_QK // 2:]  # [num_blocks, 16]
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)  # [num_blocks, 32]
    if qtype == GGMLQuantizationType.Q4_0:
        return torch.from_numpy((nibbles - 8.0) * scale).reshape(shape)
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # Q4_1
    return torch.from_numpy(nibbles * scale + minimum).reshape(shape)
