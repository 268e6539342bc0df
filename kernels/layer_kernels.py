"""Triton code of the fused elementwise kernels of a decoder layer, alone. Wrappers and torch
references: ``layer_ops.py``.

Each kernel rounds where the torch code it replaces rounds (every torch op on bf16 computes in
float32 and rounds its result), so the two agree to the last bit but for the order of the
sum of squares.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    eps, n_cols,
    stride_x, stride_residual, stride_out, stride_sum,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row per program: ``(x + residual)`` (stored to ``sum_ptr``) or ``x``, RMS-normalised
    in float32, cast to the input dtype, times the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x.dtype)  # cast back before the weight
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr, out_ptr, n_cols,
    stride_gate_up, stride_out,
    BLOCK: tl.constexpr,
):
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` rows; grid (rows, column blocks)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_gate_up + n_cols + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
