"""Prefix + causal attention of one host's chunk in APB prefill: wrapper and torch reference.

Each chunk row attends to a prefix of keys that it sees whole (the anchor block's keys, then
the passing blocks of the hosts before it) and causally to its own chunk's keys. One kernel
does both, where two flash-attention calls and a log-sum-exp merge did before.

The Triton code is in ``prefix_attention_kernel.py``. On CUDA it runs; on the CPU the torch
reference does, unless ``TRITON_INTERPRET=1`` is set (tests), as in ``attention.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import AttentionState, Backend, _interpreting, _next_pow2, _resolve_backend

_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The Triton kernel holds a [BLOCK_M, head_dim] accumulator in registers: beyond 256 it spills.
_MAX_TRITON_HEAD_DIM = 256
# Query rows per matmul in the reference: bounds its [heads, rows, keys] float32 scores.
_REFERENCE_ROWS_PER_CHUNK = 512


@dataclass(frozen=True)
class PrefixAttentionConfig:
    """Tile sizes and launch parameters of the prefix + causal attention kernel."""

    block_m: int = 128  # query rows per program
    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"PrefixAttentionConfig.{name} must be a power of two >= 16, got {value}")


# Under the interpreter: tiles small enough that a few dozen rows and keys span several of them.
INTERPRETER_CONFIG = PrefixAttentionConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)


def prefix_causal_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix_len: int, sm_scale: float
) -> AttentionState:
    """The reference: a masked softmax in float32, rows in chunks.

    Args:
        q: ``[n, num_heads, head_dim]``.
        k, v: ``[prefix_len + n, num_kv_heads, head_dim]``; query head h reads KV head
            ``h // (num_heads // num_kv_heads)``.
        prefix_len: keys every row sees; row i also sees keys ``prefix_len .. prefix_len + i``.
        sm_scale: softmax scale.

    Returns:
        ``AttentionState(out [n, num_heads, head_dim] in q's dtype, lse [n, num_heads] float32,
        natural log)``.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # [num_kv_heads, group, n, head_dim] against [num_kv_heads, 1, keys, head_dim]: the group's
    # query heads share one KV head without repeating it.
    q32 = q.float().reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    k32 = k.float().transpose(0, 1)[:, None]
    v32 = v.float().transpose(0, 1)[:, None]
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device)
    for lo in range(0, n, _REFERENCE_ROWS_PER_CHUNK):
        hi = min(lo + _REFERENCE_ROWS_PER_CHUNK, n)
        num_keys = prefix_len + hi  # keys past the last row's own are hidden from every row here
        rows = torch.arange(lo, hi, device=q.device)
        keys = torch.arange(num_keys, device=q.device)
        visible = keys[None, :] <= prefix_len + rows[:, None]  # [rows, keys]
        scores = torch.matmul(q32[:, :, lo:hi], k32[:, :, :num_keys].transpose(-1, -2)) * sm_scale
        scores = scores.masked_fill(~visible, -math.inf)  # [num_kv_heads, group, rows, keys]
        chunk_lse = torch.logsumexp(scores, dim=-1)
        chunk_out = torch.matmul(torch.softmax(scores, dim=-1), v32[:, :, :num_keys])
        out[lo:hi] = chunk_out.permute(2, 0, 1, 3).reshape(hi - lo, num_heads, head_dim).to(q.dtype)
        lse[lo:hi] = chunk_lse.permute(2, 0, 1).reshape(hi - lo, num_heads)
    return AttentionState(out, lse)


def prefix_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    prefix_len: int,
    sm_scale: float,
    backend: Backend = "auto",
    config: PrefixAttentionConfig | None = None,
    descriptors: bool | None = None,
) -> AttentionState:
    """Attention of a chunk's rows over a prefix they all see and, causally, their own keys.

    Row i sees keys ``0 .. prefix_len - 1`` (the prefix) and ``prefix_len .. prefix_len + i``
    (its chunk up to itself): key row ``prefix_len + i`` is row i's own position.
    ``prefix_len == 0`` is plain causal attention.

    Args:
        q: ``[n, num_heads, head_dim]`` float16, bfloat16 or float32.
        k, v: ``[prefix_len + n, num_kv_heads, head_dim]``, q's dtype and device; ``num_heads``
            a multiple of ``num_kv_heads`` (query head h reads KV head ``h // group``).
            Any strides over tokens and heads are read in place (a slice of a fused QKV, a row
            range of a longer K); a tensor whose last dimension is strided is copied first.
        prefix_len: keys at the head of k and v that every row sees, ``>= 0``.
        sm_scale: softmax scale, positive.
        backend: "auto" (Triton on CUDA, the torch reference on the CPU unless
            ``TRITON_INTERPRET=1``), "triton" or "torch".
        config: tile sizes of the Triton kernel; default: autotuned over a few on CUDA,
            :data:`INTERPRETER_CONFIG` under the interpreter.
        descriptors: True: the Triton kernel that moves its tiles by tensor descriptors (TMA on
            Hopper) rather than by per-thread pointer loads; it needs each token's heads
            contiguous, head_dim a power of two >= 16, 16-byte aligned rows, and float16 or
            bfloat16 (a ValueError otherwise). None or False: the pointer kernel.

    Returns:
        ``AttentionState(out [n, num_heads, head_dim] in q's dtype, lse [n, num_heads] float32,
        natural log)``. Every row sees at least its own key, so lse is finite.

    Raises:
        ValueError: a tensor of the wrong rank, shape, dtype or device; ``prefix_len`` not an
            int in range (k and v must hold ``prefix_len + n`` rows); ``sm_scale`` not positive;
            an unknown backend; head_dim above 256 on the Triton backend.
    """
    _check_inputs(q, k, v, prefix_len, sm_scale)
    resolved = _resolve_backend(_auto_backend(backend, q.device), q.device)
    n, num_heads, head_dim = q.shape
    if resolved == "triton" and head_dim > _MAX_TRITON_HEAD_DIM:
        raise ValueError(f"the Triton kernel takes head_dim up to {_MAX_TRITON_HEAD_DIM}, got {head_dim}")
    if n == 0:
        return AttentionState(torch.empty(0, num_heads, head_dim, dtype=q.dtype, device=q.device),
                              torch.empty(0, num_heads, dtype=torch.float32, device=q.device))
    if resolved == "torch":
        return prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=float(sm_scale))
    if descriptors is None:
        # The pointer kernel stays the default until the descriptor kernel is measured faster
        # on the GPU (bench/apb_kernel.py times both).
        descriptors = False
    elif descriptors:
        problem = _descriptor_layout_problem(q, k, v)
        if problem is not None:
            raise ValueError(f"descriptors=True: {problem}")
    if descriptors:
        return _prefix_causal_attention_descriptors(q, k, v, prefix_len, float(sm_scale), config)
    return _prefix_causal_attention_triton(q, k, v, prefix_len, float(sm_scale), config)


# A tensor descriptor's global strides and base address must be multiples of 16 bytes.
_DESCRIPTOR_ALIGN = 16


def _descriptor_layout_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the descriptor kernel cannot read these tensors in place, or None if it can."""
    head_dim = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the descriptor kernel takes float16 or bfloat16, got {q.dtype}"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the descriptor kernel needs head_dim a power of two >= 16, got {head_dim}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.stride(1) != head_dim:
            return f"{name}'s heads of one token must be contiguous (strides {list(t.stride())})"
        if (t.stride(0) * t.element_size()) % _DESCRIPTOR_ALIGN or t.data_ptr() % _DESCRIPTOR_ALIGN:
            return f"{name}'s rows must start on {_DESCRIPTOR_ALIGN}-byte boundaries (strides {list(t.stride())})"
    return None


def _prefix_causal_attention_descriptors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    sm_scale: float,
    config: PrefixAttentionConfig | None,
) -> AttentionState:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .prefix_attention_kernel import prefix_causal_attention_desc_autotuned, prefix_causal_attention_desc_kernel
    n, num_heads, head_dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device)
    cfg = config if config is not None else (None if q.device.type == "cuda" else INTERPRETER_CONFIG)
    block_m, block_n = (cfg.block_m, cfg.block_n) if cfg is not None else (128, 64)  # autotune resets them

    def descriptor(t: torch.Tensor, rows: int, heads: int, block_rows: int) -> TensorDescriptor:
        # [rows, heads * head_dim] over the tensor's own memory (its rows may be strided).
        return TensorDescriptor(t, shape=[rows, heads * head_dim], strides=[t.stride(0), 1],
                                block_shape=[block_rows, head_dim])

    args = (
        descriptor(q, n, num_heads, block_m), descriptor(k, num_keys, num_kv_heads, block_n),
        descriptor(v, num_keys, num_kv_heads, block_n), descriptor(out, n, num_heads, block_m), lse,
        sm_scale * math.log2(math.e), n, prefix_len, lse.stride(0),
    )
    constants = dict(QUERY_GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
                     DOT_IN_FP32=q.device.type != "cuda")
    if cfg is None:
        def grid(meta: dict) -> tuple[int, int]:
            return _cdiv(n, meta["BLOCK_M"]), num_heads
        prefix_causal_attention_desc_autotuned[grid](*args, **constants)
        return AttentionState(out, lse)
    prefix_causal_attention_desc_kernel[(_cdiv(n, cfg.block_m), num_heads)](
        *args, **constants, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return AttentionState(out, lse)


def _auto_backend(backend: Backend, device: torch.device) -> Backend:
    # attention.py's "auto" never picks Triton on the CPU; here the interpreter counts as a GPU,
    # so that the wrapper's own default path is what the CPU tests exercise.
    if backend == "auto" and device.type != "cuda" and _interpreting():
        return "triton"
    return backend


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, sm_scale: float) -> None:
    for name, t, rows in (("q", q, "n"), ("k", k, "prefix_len + n"), ("v", v, "prefix_len + n")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            heads = "num_heads" if name == "q" else "num_kv_heads"
            raise ValueError(f"{name} must be a 3-D tensor [{rows}, {heads}, head_dim], got shape {list(t.shape)}")
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    n, num_heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}")
    num_keys, num_kv_heads, kv_head_dim = k.shape
    if num_keys != prefix_len + n:
        raise ValueError(f"k and v must hold prefix_len + n = {prefix_len} + {n} = {prefix_len + n} rows, "
                         f"got {num_keys}")
    if head_dim == 0:
        raise ValueError("head_dim must be positive, got 0")
    if kv_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, k and v have {kv_head_dim}")
    if num_heads == 0 or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")


def _prefix_causal_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    sm_scale: float,
    config: PrefixAttentionConfig | None,
) -> AttentionState:
    from .prefix_attention_kernel import prefix_causal_attention_autotuned, prefix_causal_attention_kernel

    # The kernel walks tokens and heads by stride but reads head_dim as contiguous vectors.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty(n, num_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device)
    on_cuda = q.device.type == "cuda"
    args = (
        q, k, v, out, lse,
        sm_scale * math.log2(math.e), n, prefix_len,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
    )
    constants = dict(
        QUERY_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
        IEEE_DOT=q.dtype == torch.float32,
        DOT_IN_FP32=q.dtype != torch.float32 and not on_cuda,
    )
    if config is None and on_cuda:
        def grid(meta: dict) -> tuple[int, int]:
            return _cdiv(n, meta["BLOCK_M"]), num_heads

        prefix_causal_attention_autotuned[grid](*args, **constants)
        return AttentionState(out, lse)
    cfg = config or INTERPRETER_CONFIG
    prefix_causal_attention_kernel[(_cdiv(n, cfg.block_m), num_heads)](
        *args, **constants, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return AttentionState(out, lse)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
