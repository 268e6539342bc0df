"""Prefix + causal attention of APB prefill: the Triton kernel (under TRITON_INTERPRET=1 on the
CPU) against the torch reference, and the reference against float64 SDPA with an explicit mask
and against the two attention calls plus merge that APB ran before.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_testlib import (
    BACKENDS,
    LSE_TOLERANCE,
    NEEDS_INTERPRETER,
    RELATIVE_TOLERANCE,
    attention_float64,
    randn,
    relative_error,
)

import infinite_llm.kernels.prefix_attention as prefix_attention
from infinite_llm.kernels import (
    AttentionState,
    PrefixAttentionConfig,
    merge_attention_states,
    prefix_causal_attention,
    prefix_causal_attention_torch,
)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "apb_kernel.py"
HEADS = [pytest.param(4, 2, id="gqa2"), pytest.param(3, 1, id="mqa3"), pytest.param(2, 2, id="mha")]


def inputs(n: int, prefix_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
           dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"):
    """q ``[n, num_heads, head_dim]`` and k, v ``[prefix_len + n, num_kv_heads, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(n, num_heads, head_dim, dtype=dtype, gen=gen)
    k = randn(prefix_len + n, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn(prefix_len + n, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    return q.to(device), k.to(device), v.to(device)


def assert_close(got: AttentionState, want: AttentionState, dtype: torch.dtype) -> None:
    assert got.out.shape == want.out.shape and got.lse.shape == want.lse.shape
    assert got.out.dtype == dtype and got.lse.dtype == torch.float32
    assert not torch.isnan(got.out).any() and torch.isfinite(got.lse).all()
    assert relative_error(got.out.cpu(), want.out.cpu()) < RELATIVE_TOLERANCE[dtype]
    assert (got.lse.cpu() - want.lse.cpu()).abs().max().item() < LSE_TOLERANCE[dtype]


def float64_oracle(q, k, v, prefix_len: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA in float64 with the boolean mask spelt out: row i sees keys ``<= prefix_len + i``."""
    n = q.shape[0]
    return attention_float64(q, k, v, q_pos=prefix_len + torch.arange(n), key_pos=torch.arange(prefix_len + n),
                             sm_scale=sm_scale)


# --- the Triton kernel against the reference ---------------------------------------------------


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("num_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("prefix_len", [0, 7, 40])
@pytest.mark.parametrize("n", [1, 5, 33])
@NEEDS_INTERPRETER
def test_triton_matches_torch_reference(n: int, prefix_len: int, num_heads: int, num_kv_heads: int,
                                        head_dim: int) -> None:
    q, k, v = inputs(n, prefix_len, num_heads, num_kv_heads, head_dim, seed=n * 100 + prefix_len)
    sm_scale = 1.0 / math.sqrt(head_dim)
    want = prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=sm_scale)
    got = prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=sm_scale, backend="triton")
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("config", [
    pytest.param(PrefixAttentionConfig(block_m=16, block_n=16), id="16x16"),
    pytest.param(PrefixAttentionConfig(block_m=16, block_n=32), id="keys-wider-than-rows"),
    pytest.param(PrefixAttentionConfig(block_m=64, block_n=16), id="64x16"),
])
@pytest.mark.parametrize("n, prefix_len", [(33, 40), (70, 16), (17, 0)])
@NEEDS_INTERPRETER
def test_tile_shapes(config: PrefixAttentionConfig, n: int, prefix_len: int) -> None:
    """Row blocks that start and end mid key block, a prefix a whole number of key blocks long."""
    q, k, v = inputs(n, prefix_len, 4, 2, 32, seed=1)
    want = prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=0.2)
    got = prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=0.2, backend="triton", config=config)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("head_dim", [48, 80])
@NEEDS_INTERPRETER
def test_head_dim_padded_to_a_power_of_two(head_dim: int) -> None:
    q, k, v = inputs(21, 19, 4, 2, head_dim, seed=2)
    want = prefix_causal_attention_torch(q, k, v, prefix_len=19, sm_scale=head_dim**-0.5)
    got = prefix_causal_attention(q, k, v, prefix_len=19, sm_scale=head_dim**-0.5, backend="triton")
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@NEEDS_INTERPRETER
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    q, k, v = inputs(20, 24, 4, 2, 32, dtype=dtype, seed=3)
    want = prefix_causal_attention_torch(q, k, v, prefix_len=24, sm_scale=32**-0.5)
    got = prefix_causal_attention(q, k, v, prefix_len=24, sm_scale=32**-0.5, backend="triton")
    assert_close(got, want, dtype)


# --- the descriptor (TMA) kernel against the reference ------------------------------------------


def fused_inputs(n: int, prefix_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 seed: int, device: str = "cpu"):
    """q, k, v as APB prefill hands them over: views of one fused ``[tokens, q|k|v heads,
    head_dim]`` projection, rows strided, each token's heads contiguous."""
    gen = torch.Generator().manual_seed(seed)
    qkv = randn(prefix_len + n, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, gen=gen).to(device)
    return (qkv[prefix_len:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads],
            qkv[:, num_heads + num_kv_heads:])


@pytest.mark.parametrize("config", [
    pytest.param(None, id="default-tiles"),
    pytest.param(PrefixAttentionConfig(block_m=16, block_n=16), id="16x16"),
    pytest.param(PrefixAttentionConfig(block_m=16, block_n=32), id="keys-wider-than-rows"),
])
@pytest.mark.parametrize("n, prefix_len", [(1, 0), (33, 40), (70, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@NEEDS_INTERPRETER
def test_descriptor_kernel_matches_torch_reference(dtype: torch.dtype, n: int, prefix_len: int,
                                                   config: PrefixAttentionConfig | None) -> None:
    """Row blocks past the last row and key blocks past the last key (zeros loaded there, nothing
    stored), fused strided inputs read in place."""
    q, k, v = fused_inputs(n, prefix_len, 4, 2, 32, dtype, seed=n + prefix_len)
    want = prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=32**-0.5)
    got = prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=32**-0.5, backend="triton",
                                  config=config, descriptors=True)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("change, message", [
    pytest.param("float32", "float16 or bfloat16", id="fp32"),
    pytest.param("head_dim_48", "power of two", id="head-dim"),
    pytest.param("heads_strided", "contiguous", id="heads-strided"),
])
@NEEDS_INTERPRETER
def test_descriptors_asked_for_where_the_layout_does_not_allow_them_raise(change: str, message: str) -> None:
    dtype = torch.float32 if change == "float32" else torch.bfloat16
    head_dim = 48 if change == "head_dim_48" else 32
    q, k, v = inputs(9, 5, 4, 2, head_dim, dtype=dtype, seed=5)
    if change == "heads_strided":
        k = torch.cat([k, k], dim=1)[:, ::2]
    with pytest.raises(ValueError, match=message):
        prefix_causal_attention(q, k, v, prefix_len=5, sm_scale=0.2, backend="triton", descriptors=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views(backend: str) -> None:
    """q from a fused [tokens, q|k|v heads, head_dim] tensor, k and v a row range and every other
    head of longer tensors, v strided in head_dim (copied): the same result as contiguous copies."""
    n, prefix_len, num_heads, num_kv_heads, head_dim = 19, 13, 4, 2, 32
    gen = torch.Generator().manual_seed(4)
    qkv = randn(n, num_heads + 2 * num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    q = qkv[:, :num_heads]
    k = randn(prefix_len + n + 5, 2 * num_kv_heads, head_dim, dtype=torch.float32, gen=gen)[3:-2, ::2]
    v = randn(prefix_len + n, num_kv_heads, 2 * head_dim, dtype=torch.float32, gen=gen)[..., ::2]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    got = prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=0.3, backend=backend)
    want = prefix_causal_attention_torch(q.contiguous(), k.contiguous(), v.contiguous(), prefix_len=prefix_len,
                                         sm_scale=0.3)
    assert_close(got, want, torch.float32)


@NEEDS_INTERPRETER
def test_every_output_element_is_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapper's outputs start as NaN; none may survive (rows past the last row block's end,
    heads of the last group)."""
    q, k, v = inputs(37, 9, 6, 2, 32, seed=5)
    want = prefix_causal_attention_torch(q, k, v, prefix_len=9, sm_scale=0.2)
    allocate = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = allocate(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    got = prefix_causal_attention(q, k, v, prefix_len=9, sm_scale=0.2, backend="triton")
    monkeypatch.undo()
    assert_close(got, want, torch.float32)


# --- the reference against independent computations -------------------------------------------


@pytest.mark.parametrize("n, prefix_len, num_heads, num_kv_heads, head_dim", [
    (1, 0, 2, 2, 32), (5, 7, 4, 2, 32), (33, 40, 3, 1, 64), (40, 3, 8, 2, 16), (600, 50, 2, 1, 16),
])
def test_torch_reference_matches_masked_float64_sdpa(n: int, prefix_len: int, num_heads: int, num_kv_heads: int,
                                                     head_dim: int) -> None:
    """600 rows: the reference's row chunks (512) meet."""
    q, k, v = inputs(n, prefix_len, num_heads, num_kv_heads, head_dim, seed=6)
    got = prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=0.25)
    want_out, want_lse = float64_oracle(q, k, v, prefix_len, 0.25)
    assert relative_error(got.out, want_out) < 1e-5
    assert (got.lse.double() - want_lse).abs().max() < 1e-4


@pytest.mark.parametrize("n, prefix_len", [(5, 7), (33, 40), (12, 1)])
def test_torch_reference_matches_two_calls_merged(n: int, prefix_len: int) -> None:
    """What apb_prefill computed before: the chunk causally, the prefix whole, merged by LSE."""
    q, k, v = inputs(n, prefix_len, 4, 2, 32, seed=7)
    got = prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=0.2)
    own = attention_float64(q, k[prefix_len:], v[prefix_len:], q_pos=torch.arange(n), key_pos=torch.arange(n),
                            sm_scale=0.2)
    prefix = attention_float64(q, k[:prefix_len], v[:prefix_len], q_pos=None, key_pos=torch.arange(prefix_len),
                               sm_scale=0.2)
    merged = merge_attention_states([own[0].float(), prefix[0].float()], [own[1].float(), prefix[1].float()],
                                    backend="torch")
    assert relative_error(got.out, merged.out) < 1e-5
    assert (got.lse - merged.lse).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_prefix_is_causal_sdpa(backend: str) -> None:
    q, k, v = inputs(29, 0, 4, 2, 32, seed=8)
    got = prefix_causal_attention(q, k, v, prefix_len=0, sm_scale=32**-0.5, backend=backend)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          enable_gqa=True).transpose(0, 1)
    assert relative_error(got.out, want) < RELATIVE_TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows(backend: str) -> None:
    q, k, v = inputs(0, 6, 4, 2, 32)
    got = prefix_causal_attention(q, k, v, prefix_len=6, sm_scale=0.2, backend=backend)
    assert got.out.shape == (0, 4, 32) and got.out.dtype == torch.float32
    assert got.lse.shape == (0, 4) and got.lse.dtype == torch.float32


# --- choosing the backend, and bad input --------------------------------------------------------


def test_auto_is_the_reference_on_the_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(prefix_attention, "_prefix_causal_attention_triton", None)  # calling it would fail
    q, k, v = inputs(5, 3, 2, 1, 32)
    got = prefix_causal_attention(q, k, v, prefix_len=3, sm_scale=0.2)
    assert_close(got, prefix_causal_attention_torch(q, k, v, prefix_len=3, sm_scale=0.2), torch.float32)
    with pytest.raises(ValueError, match=r"backend='triton' on a CPU tensor needs TRITON_INTERPRET=1"):
        prefix_causal_attention(q, k, v, prefix_len=3, sm_scale=0.2, backend="triton")


@NEEDS_INTERPRETER
def test_auto_is_triton_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_attention, "prefix_causal_attention_torch", None)  # calling it would fail
    q, k, v = inputs(5, 3, 2, 1, 32)
    got = prefix_causal_attention(q, k, v, prefix_len=3, sm_scale=0.2)
    assert got.out.shape == (5, 2, 32)


def valid_args() -> dict:
    q, k, v = inputs(4, 3, 4, 2, 32)
    return {"q": q, "k": k, "v": v, "prefix_len": 3, "sm_scale": 0.2, "backend": "torch"}


BAD_INPUTS = [
    ("q-2d", {"q": lambda a: a["q"][:, 0]}, r"q must be a 3-D tensor \[n, num_heads, head_dim\], got shape \[4, 32\]"),
    ("k-not-tensor", {"k": lambda a: a["k"].tolist()}, r"k must be a torch.Tensor, got list"),
    ("v-4d", {"v": lambda a: a["v"][None]}, r"v must be a 3-D tensor \[prefix_len \+ n, num_kv_heads, head_dim\]"),
    ("kv-shapes", {"v": lambda a: a["v"][:, :1]}, r"k and v must have one shape, got \[7, 2, 32\] and \[7, 1, 32\]"),
    ("kv-rows", {"prefix_len": 2}, r"k and v must hold prefix_len \+ n = 2 \+ 4 = 6 rows, got 7"),
    ("prefix-too-long", {"prefix_len": 8}, r"k and v must hold prefix_len \+ n = 8 \+ 4 = 12 rows, got 7"),
    ("prefix-negative", {"prefix_len": -1}, r"prefix_len must be an int >= 0, got -1"),
    ("prefix-float", {"prefix_len": 3.0}, r"prefix_len must be an int >= 0, got 3.0"),
    ("prefix-bool", {"prefix_len": True}, r"prefix_len must be an int >= 0, got True"),
    ("head-dim", {"k": lambda a: a["k"][..., :16], "v": lambda a: a["v"][..., :16]},
     r"q has head_dim 32, k and v have 16"),
    ("head-dim-zero", {"q": lambda a: a["q"][..., :0], "k": lambda a: a["k"][..., :0], "v": lambda a: a["v"][..., :0]},
     r"head_dim must be positive, got 0"),
    ("heads-not-multiple", {"q": lambda a: a["q"][:, :3]}, r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)"),
    ("dtype-int", {"q": lambda a: a["q"].int(), "k": lambda a: a["k"].int(), "v": lambda a: a["v"].int()},
     r"q dtype must be float16, bfloat16 or float32, got torch.int32"),
    ("dtypes-differ", {"k": lambda a: a["k"].half()},
     r"q, k and v must share one dtype, got torch.float32, torch.float16 and torch.float32"),
    ("devices-differ", {"v": lambda a: a["v"].to("meta")},
     r"q, k and v must be on one device, got cpu, cpu and meta"),
    ("scale-zero", {"sm_scale": 0.0}, r"sm_scale must be a positive finite number, got 0.0"),
    ("scale-nan", {"sm_scale": math.nan}, r"sm_scale must be a positive finite number, got nan"),
    ("backend", {"backend": "cuda"}, r"backend must be 'auto', 'triton' or 'torch', got 'cuda'"),
]


@pytest.mark.parametrize("changes, message", [pytest.param(c, m, id=i) for i, c, m in BAD_INPUTS])
def test_bad_input_raises(changes: dict, message: str) -> None:
    args = valid_args()
    args.update({key: (change(args) if callable(change) else change) for key, change in changes.items()})
    with pytest.raises(ValueError, match=message):
        prefix_causal_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@NEEDS_INTERPRETER
def test_head_dim_past_the_kernel_raises_on_triton_only() -> None:
    q, k, v = inputs(2, 1, 1, 1, 264)
    with pytest.raises(ValueError, match=r"the Triton kernel takes head_dim up to 256, got 264"):
        prefix_causal_attention(q, k, v, prefix_len=1, sm_scale=0.1, backend="triton")
    assert prefix_causal_attention(q, k, v, prefix_len=1, sm_scale=0.1, backend="torch").out.shape == (2, 1, 264)


def test_config_refuses_tiles_that_are_not_powers_of_two() -> None:
    with pytest.raises(ValueError, match=r"PrefixAttentionConfig.block_n must be a power of two >= 16, got 48"):
        PrefixAttentionConfig(block_n=48)
    with pytest.raises(ValueError, match=r"PrefixAttentionConfig.block_m must be a power of two >= 16, got 8"):
        PrefixAttentionConfig(block_m=8)


# --- the benchmark's smoke run, and the GPU -----------------------------------------------------


def test_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "apb_kernel.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], timeout=120,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["tflops"]) >= {"triton", "sdpa_two_calls", "flash_two_calls_merged"}
    assert row["max_abs_error_vs_reference"]["triton"] < 1e-4
    assert row["max_abs_error_vs_reference"]["flash_two_calls_merged"] < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("n, prefix_len, num_heads, num_kv_heads, head_dim, dtype", [
    pytest.param(2048, 1024, 32, 8, 128, torch.bfloat16, id="llama8b-bf16"),
    pytest.param(1000, 333, 8, 2, 64, torch.float16, id="d64-fp16"),
    pytest.param(300, 77, 4, 4, 128, torch.float32, id="d128-fp32"),
    pytest.param(257, 64, 6, 2, 80, torch.bfloat16, id="d80-padded-bf16"),
    pytest.param(1, 0, 32, 8, 128, torch.bfloat16, id="one-row"),
])
def test_triton_on_cuda_matches_reference(n: int, prefix_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                          dtype: torch.dtype) -> None:
    """The autotuned launch and each tile config it chooses from."""
    from triton.runtime.errors import OutOfResources

    from infinite_llm.kernels.prefix_attention_kernel import CUDA_CONFIGS, CUDA_DESCRIPTOR_CONFIGS

    q, k, v = inputs(n, prefix_len, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=9, device="cuda")
    sm_scale = head_dim**-0.5
    want = prefix_causal_attention_torch(q, k, v, prefix_len=prefix_len, sm_scale=sm_scale)
    assert_close(prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=sm_scale), want, dtype)
    kernels = [(False, CUDA_CONFIGS)]
    if torch.cuda.get_device_capability()[0] >= 9 and dtype != torch.float32 and head_dim in (64, 128):
        kernels.append((True, CUDA_DESCRIPTOR_CONFIGS))
        assert_close(prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=sm_scale, descriptors=True),
                     want, dtype)
    for descriptors, configs in kernels:
        num_ran = 0
        for c in configs:
            config = PrefixAttentionConfig(block_m=c.kwargs["BLOCK_M"], block_n=c.kwargs["BLOCK_N"],
                                           num_warps=c.num_warps, num_stages=c.num_stages)
            try:
                got = prefix_causal_attention(q, k, v, prefix_len=prefix_len, sm_scale=sm_scale, config=config,
                                              descriptors=descriptors)
            except OutOfResources:  # fp32 tiles of the largest config exceed shared memory; autotune skips them too
                continue
            assert_close(got, want, dtype)
            num_ran += 1
        assert num_ran >= 2, f"descriptors={descriptors}: {num_ran} configs ran"
