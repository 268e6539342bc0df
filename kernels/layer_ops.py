"""The elementwise parts of a decoder layer, fused: RMSNorm (optionally after the residual add)
and SwiGLU's ``silu(gate) * up``.

On CUDA a decode step of a small batch is hundreds of tiny kernels; in torch an RMSNorm alone
is seven (cast, square, mean, rsqrt, multiply, cast, weight). Each function here is one Triton
kernel on CUDA and its torch reference on the CPU (or with ``backend="torch"``); the references
are the engine's CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import Backend, _next_pow2, _resolve_backend

_SILU_BLOCK = 1024


def _use_triton(backend: Backend, x: torch.Tensor) -> bool:
    return _resolve_backend(backend, x.device) == "triton"


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be 2-D [rows, cols] and contiguous in its last dimension, got shape "
                         f"{list(t.shape)} strides {list(t.stride())}")


# --- torch references ------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back before the weight (as the reference models do)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return rms_norm_torch(summed, weight, eps), summed


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- wrappers --------------------------------------------------------------------------------


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    from .layer_kernels import rms_norm_kernel

    _check_rows("x", x)
    rows, cols = x.shape
    if weight.shape != (cols,):
        raise ValueError(f"weight must be [{cols}], got {list(weight.shape)}")
    out = torch.empty_like(x)
    summed = None
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {list(residual.shape)} {residual.dtype} must match x {list(x.shape)} {x.dtype}")
        summed = torch.empty_like(x)
    if rows:
        block = _next_pow2(cols)
        rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, summed if summed is not None else out,
            eps, cols,
            x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            summed.stride(0) if summed is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 512)),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: Backend = "auto") -> torch.Tensor:
    """``x [rows, hidden]`` -> RMSNorm of each row times ``weight [hidden]``, in x's dtype."""
    if not _use_triton(backend, x):
        return rms_norm_torch(x, weight, eps)
    return _launch_rms_norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass.

    Args:
        x, residual: ``[rows, hidden]``, one dtype.
        weight: ``[hidden]``.

    Returns:
        ``(rms_norm(residual + x) * weight, residual + x)``, both ``[rows, hidden]``.
    """
    if not _use_triton(backend, x):
        return add_rms_norm_torch(x, residual, weight, eps)
    out, summed = _launch_rms_norm(x, residual, weight, eps)
    return out, summed


def silu_and_mul(gate_up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """``gate_up [rows, 2 * ffn]`` (gate then up) -> ``silu(gate) * up`` ``[rows, ffn]``."""
    if not _use_triton(backend, gate_up):
        return silu_and_mul_torch(gate_up)
    from .layer_kernels import silu_and_mul_kernel

    _check_rows("gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {width}")
    cols = width // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        silu_and_mul_kernel[(rows, -(-cols // _SILU_BLOCK))](
            gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=_SILU_BLOCK, num_warps=4)
    return out
