"""The fused RMSNorm and SwiGLU kernels (under TRITON_INTERPRET=1 on the CPU) against their
torch references, which are the engine's CPU path."""

from __future__ import annotations

import pytest
import torch
from attention_testlib import NEEDS_INTERPRETER

from infinite_llm.kernels.layer_ops import (
    add_rms_norm,
    add_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
    silu_and_mul,
    silu_and_mul_torch,
)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def tolerance(dtype: torch.dtype) -> dict:
    # bf16: a few rounding steps (2^-8 each) apart: the sum of squares is added in another
    # order, and Triton's interpreter rounds bf16 casts its own way.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def rows(n: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(n, cols, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 96])  # a power of two, and not (masked columns)
def test_rms_norm_kernel_matches_reference(dtype, cols):
    x = rows(5, cols, dtype, 0)
    weight = rows(1, cols, dtype, 1)[0]
    torch.testing.assert_close(rms_norm(x, weight, 1e-5, backend="triton"), rms_norm_torch(x, weight, 1e-5),
                               **tolerance(dtype))


@NEEDS_INTERPRETER
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_kernel_matches_reference(dtype):
    x, residual = rows(4, 80, dtype, 2), rows(4, 80, dtype, 3)
    weight = rows(1, 80, dtype, 4)[0]
    out, summed = add_rms_norm(x, residual, weight, 1e-6, backend="triton")
    out_ref, summed_ref = add_rms_norm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, summed_ref, **tolerance(dtype))
    torch.testing.assert_close(out, out_ref, **tolerance(dtype))


@NEEDS_INTERPRETER
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_kernel_matches_reference(dtype):
    gate_up = rows(3, 2 * 1100, dtype, 5)  # more than one column block, the last one partial
    torch.testing.assert_close(silu_and_mul(gate_up, backend="triton"), silu_and_mul_torch(gate_up),
                               **tolerance(dtype))


def test_cpu_default_is_the_reference_and_bad_shapes_are_refused():
    x = rows(2, 8, torch.float32, 6)
    weight = torch.ones(8)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5))
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, weight, 1e-5, backend="cuda")


@NEEDS_INTERPRETER
def test_bad_shapes_are_refused_before_launch():
    x = rows(2, 8, torch.float32, 7)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(9), 1e-5, backend="triton")
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, rows(3, 8, torch.float32, 8), torch.ones(8), 1e-5, backend="triton")
    with pytest.raises(ValueError, match="even number"):
        silu_and_mul(rows(2, 7, torch.float32, 9), backend="triton")
    with pytest.raises(ValueError, match="2-D"):
        rms_norm(x[None], torch.ones(8), 1e-5, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_cuda_match_reference_in_bf16():
    x = rows(33, 4096, torch.bfloat16, 10).cuda()
    residual = rows(33, 4096, torch.bfloat16, 11).cuda()
    weight = rows(1, 4096, torch.bfloat16, 12)[0].cuda()
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5), atol=2e-2, rtol=1e-2)
    out, summed = add_rms_norm(x, residual, weight, 1e-5)
    out_ref, summed_ref = add_rms_norm_torch(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, summed_ref, atol=0, rtol=0)  # one rounding, as torch's add
    torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=1e-2)
    gate_up = rows(33, 2 * 14336, torch.bfloat16, 13).cuda()
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up), atol=2e-2, rtol=1e-2)
