"""Wrappers of the attention kernels: check the inputs, plan the launch, pick the version.

On CUDA the Triton kernels run; on the CPU the torch references do (``reference.py``), unless
``backend="triton"`` asks for the Triton kernels under ``TRITON_INTERPRET=1`` (tests).

Every log-sum-exp returned here is a natural logarithm, float32, ``-inf`` for a row that saw
no key (whose output is zero).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

import torch

from .kv_pool import KVPoolShape
from .reference import merge_attention_states_torch, micro_attention_torch, write_kv_torch

Backend = Literal["auto", "triton", "torch"]
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPE = torch.int32
# A split shorter than this many KV tiles costs more in its merge than it gains in parallelism.
_MIN_TILES_PER_SPLIT = 4
# Launch shapes that measured well on an H200 (bench/results/kernels-sweep-h200.json): either
# at most about two programs per SM, each streaming a long run of keys, or at least about
# eight per SM; between the two, bandwidth dropped by up to 15%.
_FEW_PROGRAMS_PER_SM = 2
_MANY_PROGRAMS_PER_SM = 8
# SMs assumed when the Triton kernels run on the CPU under the interpreter.
_INTERPRETER_SMS = 8


class AttentionState(NamedTuple):
    """A (partial) attention result.

    out: ``[num_q_tokens, num_heads, head_dim]``.
    lse: ``[num_q_tokens, num_heads]`` float32, natural log of the softmax denominator.
    """

    out: torch.Tensor
    lse: torch.Tensor


@dataclass(frozen=True)
class MicroAttentionConfig:
    """Tile sizes and launch parameters of the MicroAttention kernel."""

    tile_n: int = 64  # keys per loop iteration
    rows_per_program: int = 16  # BLOCK_Q * GROUP_PAD: score-tile rows (query rows x heads)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("tile_n", "rows_per_program"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MicroAttentionConfig.{name} must be a power of two >= 16, got {value}")


# Decode: the best of a sweep of tile sizes, warps and stages on an H200 (bf16, head_dim 128).
DECODE_CONFIG = MicroAttentionConfig(tile_n=128, rows_per_program=16, num_warps=4, num_stages=3)
PREFILL_CONFIG = MicroAttentionConfig(tile_n=64, rows_per_program=64, num_warps=4, num_stages=2)


@dataclass(frozen=True)
class MicroAttentionPlan:
    """Everything about one batch's MicroAttention that is the same for every layer.

    Build it once per engine step with :func:`plan_micro_attention` (it validates the block
    tables, which on CUDA costs a device sync) and run it per layer with
    :func:`run_micro_attention`.
    """

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    kv_lens: torch.Tensor  # [num_seqs] int32, keys held here
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    kv_start_pos: torch.Tensor | None  # [num_seqs] int32 absolute position of the first key
    q_pos: torch.Tensor | None  # [num_q_tokens] int32 absolute positions; None: no causal mask
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    num_q_tokens: int
    max_query_len: int
    max_kv_len: int
    backend: Literal["triton", "torch"]
    config: MicroAttentionConfig
    num_splits: int
    tiles_per_split: int
    group_pad: int  # query heads per KV head, rounded up to a power of two
    rows_per_tile: int  # query rows per program
    tile_seq: torch.Tensor | None  # [num_q_tiles] int32, multi-row batches only
    tile_row: torch.Tensor | None  # [num_q_tiles] int32, multi-row batches only
    num_q_tiles: int

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def causal(self) -> bool:
        return self.q_pos is not None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        if device.type != "cuda" and not _interpreting():
            raise ValueError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before import")
        return "triton"
    raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def choose_num_splits(
    num_programs_per_split: int,
    max_kv_tiles: int,
    num_sms: int,
    *,
    programs_per_sm: int | None = None,
    min_tiles_per_split: int = _MIN_TILES_PER_SPLIT,
) -> tuple[int, int]:
    """Split the keys of each sequence so that the launch fills the GPU.

    Args:
        num_programs_per_split: programs of one split (query tiles x KV heads).
        max_kv_tiles: KV tiles of the longest sequence.
        num_sms: streaming multiprocessors of the device.
        programs_per_sm: aim for this many programs per SM; default: as many splits as fit
            in about two programs per SM when the batch is small, else about eight per SM.
        min_tiles_per_split: no split shorter than this (unless one split covers everything).

    Returns:
        ``(num_splits, tiles_per_split)``.
    """
    if max_kv_tiles <= 0:
        return 1, 1
    most = max(1, max_kv_tiles // min_tiles_per_split)
    base = max(1, num_programs_per_split)
    if programs_per_sm is not None:
        wanted = math.ceil(programs_per_sm * num_sms / base)
    elif base <= _FEW_PROGRAMS_PER_SM * num_sms:
        wanted = (_FEW_PROGRAMS_PER_SM * num_sms) // base
    else:
        wanted = math.ceil(_MANY_PROGRAMS_PER_SM * num_sms / base)
    num_splits = max(1, min(wanted, most))
    tiles_per_split = math.ceil(max_kv_tiles / num_splits)
    return math.ceil(max_kv_tiles / tiles_per_split), tiles_per_split


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _INDEX_DTYPE:
        raise ValueError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def plan_micro_attention(
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    kv_start_pos: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_kv_len: int | None = None,
    check_bounds: bool = True,
    backend: Backend = "auto",
    num_splits: int | None = None,
    config: MicroAttentionConfig | None = None,
) -> MicroAttentionPlan:
    """Validate one batch's metadata and plan its MicroAttention launch.

    Args:
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; row i lists the pool blocks of
            sequence i in token order. Entries past a row's last used block are ignored.
        kv_lens: ``[num_seqs]`` int32, keys of each sequence held in this pool.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query rows (starts at 0).
        num_heads, num_kv_heads, head_dim: the attention shape (``num_heads`` a multiple of
            ``num_kv_heads``).
        block_size, num_blocks: the pool's tokens per block and block count.
        kv_start_pos: ``[num_seqs]`` int32, absolute position of the first key held here;
            defaults to 0. Used only with ``q_pos``.
        q_pos: ``[num_q_tokens]`` int32 absolute positions of the query rows: a row attends to
            the keys at positions ``<= q_pos``. None: every row attends to every key held here
            (decode on a pool holding only older keys).
        max_query_len, max_kv_len: host-side maxima; given, the plan needs no device sync
            for them.
        check_bounds: check the block ids, lengths and row offsets against the pool (syncs
            with the device once).
        backend: "auto" (Triton on CUDA, torch on the CPU), "triton" or "torch".
        num_splits: force the number of key splits (tests and benchmarks); default: chosen
            from the shape and the number of SMs.
        config: tile sizes; default: one for decode, one for multi-row batches.
    """
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        raise ValueError("block_tables must be a 2-D int32 tensor [num_seqs, max_blocks_per_seq]")
    device = block_tables.device
    num_seqs = block_tables.shape[0]
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    _check_index("block_tables", block_tables, tuple(block_tables.shape), device)
    _check_index("kv_lens", kv_lens, (num_seqs,), device)
    _check_index("query_start_loc", query_start_loc, (num_seqs + 1,), device)
    if q_pos is None and kv_start_pos is not None:
        raise ValueError("kv_start_pos is only meaningful with q_pos (the causal mask)")
    if q_pos is not None:
        if q_pos.dim() != 1:
            raise ValueError(f"q_pos must be 1-D [num_q_tokens], got shape {list(q_pos.shape)}")
        _check_index("q_pos", q_pos, (q_pos.shape[0],), device)
        if kv_start_pos is None:
            kv_start_pos = torch.zeros(num_seqs, dtype=_INDEX_DTYPE, device=device)
        _check_index("kv_start_pos", kv_start_pos, (num_seqs,), device)
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")

    if check_bounds or max_query_len is None or max_kv_len is None:
        starts = query_start_loc.cpu()
        lens = kv_lens.cpu()
        q_lens = starts[1:] - starts[:-1]
        if num_seqs and (starts[0] != 0 or bool((q_lens < 0).any())):
            raise ValueError("query_start_loc must start at 0 and never decrease")
        if bool((lens < 0).any()):
            raise ValueError("kv_lens must be >= 0")
        longest_query = int(q_lens.max()) if num_seqs else 0
        longest_kv = int(lens.max()) if num_seqs else 0
        if max_query_len is None:
            max_query_len = longest_query
        if max_kv_len is None:
            max_kv_len = longest_kv
        if check_bounds:
            # The launch grid and the key splits are sized from these: too small a value leaves
            # rows unwritten or keys unread.
            if max_query_len < longest_query:
                raise ValueError(f"max_query_len {max_query_len} is less than the longest query ({longest_query} rows)")
            if max_kv_len < longest_kv:
                raise ValueError(f"max_kv_len {max_kv_len} is less than the longest sequence ({longest_kv} keys)")
            blocks_needed = (lens + block_size - 1) // block_size
            if num_seqs and int(blocks_needed.max()) > block_tables.shape[1]:
                seq = int(blocks_needed.argmax())
                raise ValueError(
                    f"sequence {seq} holds {int(lens[seq])} keys = {int(blocks_needed[seq])} blocks, "
                    f"but block_tables has only {block_tables.shape[1]} columns"
                )
            used = torch.arange(block_tables.shape[1])[None, :] < blocks_needed[:, None]
            used_ids = block_tables.cpu()[used]
            if used_ids.numel() and (int(used_ids.min()) < 0 or int(used_ids.max()) >= num_blocks):
                bad = used_ids[(used_ids < 0) | (used_ids >= num_blocks)][0]
                raise ValueError(f"block_tables holds block id {int(bad)} outside the pool's [0, {num_blocks})")
            if q_pos is not None and q_pos.shape[0] != int(starts[-1]):
                raise ValueError(f"q_pos has {q_pos.shape[0]} rows, query_start_loc says {int(starts[-1])}")
    num_q_tokens = q_pos.shape[0] if q_pos is not None else -1

    resolved = _resolve_backend(backend, device)
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    multi_row = max_query_len > 1
    if config is None:
        config = PREFILL_CONFIG if multi_row else DECODE_CONFIG
    if multi_row:
        rows_per_tile = max(1, config.rows_per_program // group_pad)
    else:
        rows_per_tile = 1
    # tl.dot needs at least 16 rows: pad the head group when a tile has fewer.
    group_pad = max(group_pad, 16 // rows_per_tile) if rows_per_tile * group_pad < 16 else group_pad

    tile_seq = tile_row = None
    if multi_row and resolved == "triton":
        starts_dev = query_start_loc
        q_lens_dev = starts_dev[1:] - starts_dev[:-1]
        tiles_per_seq = (q_lens_dev + rows_per_tile - 1) // rows_per_tile
        cum_tiles = torch.cumsum(tiles_per_seq, 0)
        total_rows_bound = num_seqs * max_query_len
        num_q_tiles = min(num_seqs * math.ceil(max_query_len / rows_per_tile), num_seqs + total_rows_bound // rows_per_tile)
        tile_ids = torch.arange(num_q_tiles, device=device)
        seq_of_tile = torch.searchsorted(cum_tiles, tile_ids, right=True).clamp_(max=max(num_seqs - 1, 0))
        first_tile = cum_tiles[seq_of_tile] - tiles_per_seq[seq_of_tile]
        tile_row = (starts_dev[seq_of_tile] + (tile_ids - first_tile) * rows_per_tile).to(_INDEX_DTYPE)
        tile_seq = seq_of_tile.to(_INDEX_DTYPE)
    else:
        num_q_tiles = num_seqs

    max_kv_tiles = math.ceil(max_kv_len / config.tile_n)
    if num_splits is None:
        splits, tiles_per_split = choose_num_splits(num_q_tiles * num_kv_heads, max_kv_tiles, _num_sms(device))
    else:
        if num_splits <= 0:
            raise ValueError(f"num_splits must be positive, got {num_splits}")
        tiles_per_split = max(1, math.ceil(max_kv_tiles / num_splits))
        splits = num_splits

    return MicroAttentionPlan(
        block_tables=block_tables,
        kv_lens=kv_lens,
        query_start_loc=query_start_loc,
        kv_start_pos=kv_start_pos,
        q_pos=q_pos,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_q_tokens=num_q_tokens,
        max_query_len=max_query_len,
        max_kv_len=max_kv_len,
        backend=resolved,
        config=config,
        num_splits=splits,
        tiles_per_split=tiles_per_split,
        group_pad=group_pad,
        rows_per_tile=rows_per_tile,
        tile_seq=tile_seq,
        tile_row=tile_row,
        num_q_tiles=num_q_tiles,
    )


def _check_pool(kv_pool: torch.Tensor, layer: int) -> KVPoolShape:
    if not isinstance(kv_pool, torch.Tensor):
        raise ValueError(f"kv_pool must be a torch.Tensor, got {type(kv_pool).__name__}")
    shape = KVPoolShape.of(kv_pool)
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")
    if kv_pool.dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"kv_pool dtype must be float16, bfloat16 or float32, got {kv_pool.dtype}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < shape.num_layers:
        raise ValueError(f"layer must be an int in [0, {shape.num_layers}), got {layer!r}")
    return shape


def run_micro_attention(
    plan: MicroAttentionPlan,
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    *,
    sm_scale: float | None = None,
    out_dtype: torch.dtype = torch.float32,
    return_lse: bool = True,
    into: AttentionState | None = None,
) -> AttentionState:
    """Run a planned MicroAttention for one layer.

    Args:
        plan: from :func:`plan_micro_attention`.
        q: ``[num_q_tokens, num_heads, head_dim]``, the dtype of ``kv_pool``.
        kv_pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: the layer whose K and V are read.
        sm_scale: softmax scale, default ``1 / sqrt(head_dim)``.
        out_dtype: dtype of the returned partial output (float32 keeps merges exact).
        return_lse: False when the caller needs the output alone (the whole sequence is
            here): the log-sum-exp is then left unwritten (its tensor holds garbage).
        into: where the result goes (a creditor's mailbox slots), ``AttentionState(out
            [num_q_tokens, num_heads, head_dim] out_dtype, lse [num_q_tokens, num_heads]
            float32)``, each contiguous in its last dimension: the kernels write there, so no
            copy follows the attention on the path a home waits on. None: new tensors.

    Returns:
        ``AttentionState(out [num_q_tokens, num_heads, head_dim] out_dtype,
        lse [num_q_tokens, num_heads] float32 natural log)``.
    """
    pool = _check_pool(kv_pool, layer)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a 3-D tensor [num_q_tokens, num_heads, head_dim]")
    num_q_tokens, num_heads, head_dim = q.shape
    if q.dtype != kv_pool.dtype:
        raise ValueError(f"q is {q.dtype} but kv_pool is {kv_pool.dtype}: they must match")
    if q.device != kv_pool.device or q.device != plan.block_tables.device:
        raise ValueError(
            f"q ({q.device}), kv_pool ({kv_pool.device}) and the plan ({plan.block_tables.device}) "
            "must be on one device"
        )
    if (num_heads, head_dim) != (plan.num_heads, plan.head_dim) or pool.num_kv_heads != plan.num_kv_heads:
        raise ValueError(
            f"q has {num_heads} heads of dim {head_dim} over a pool of {pool.num_kv_heads} KV heads; "
            f"the plan was made for {plan.num_heads} heads of dim {plan.head_dim} over {plan.num_kv_heads}"
        )
    if pool.head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} differs from kv_pool head_dim {pool.head_dim}")
    if pool.block_size != plan.block_size:
        raise ValueError(f"kv_pool block_size {pool.block_size} differs from the plan's {plan.block_size}")
    if plan.q_pos is not None and plan.q_pos.shape[0] != num_q_tokens:
        raise ValueError(f"q has {num_q_tokens} rows but the plan's q_pos has {plan.q_pos.shape[0]}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    if out_dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if into is not None:
        _check_into(into, num_q_tokens, num_heads, head_dim, out_dtype, q.device)

    if plan.backend == "torch":
        out, lse = micro_attention_torch(
            q, kv_pool, layer, plan.block_tables, plan.kv_lens, plan.query_start_loc,
            plan.kv_start_pos, plan.q_pos, sm_scale, out_dtype,
        )
        if into is None:
            return AttentionState(out, lse)
        into.out.copy_(out)
        into.lse.copy_(lse)
        return into
    return _micro_attention_triton(plan, q, kv_pool, layer, sm_scale, out_dtype, return_lse, into)


def _check_into(into: AttentionState, num_rows: int, num_heads: int, head_dim: int,
                out_dtype: torch.dtype, device: torch.device) -> None:
    out, lse = into.out, into.lse
    if tuple(out.shape) != (num_rows, num_heads, head_dim) or tuple(lse.shape) != (num_rows, num_heads):
        raise ValueError(f"into holds out {tuple(out.shape)} and lse {tuple(lse.shape)}; the attention "
                         f"writes out {(num_rows, num_heads, head_dim)} and lse {(num_rows, num_heads)}")
    if out.dtype != out_dtype or lse.dtype != torch.float32:
        raise ValueError(f"into holds out {out.dtype} and lse {lse.dtype}; the attention writes "
                         f"out {out_dtype} and lse torch.float32")
    if out.device != device or lse.device != device:
        raise ValueError(f"into is on {out.device} and {lse.device}, the query on {device}")
    if out.stride(-1) != 1 or lse.stride(-1) != 1:
        raise ValueError("into's out and lse must be contiguous in their last dimension")


def _micro_attention_triton(
    plan: MicroAttentionPlan,
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    sm_scale: float,
    out_dtype: torch.dtype,
    return_lse: bool,
    into: AttentionState | None = None,
) -> AttentionState:
    from .triton_kernels import micro_attention_kernel

    num_q_tokens, num_heads, head_dim = q.shape
    splits = plan.num_splits
    if splits == 1:
        if into is None:
            out = torch.empty(num_q_tokens, num_heads, head_dim, dtype=out_dtype, device=q.device)
            lse = torch.empty(num_q_tokens, num_heads, dtype=torch.float32, device=q.device)
        else:
            out, lse = into.out, into.lse
            return_lse = True
        out_split, lse_split = out.unsqueeze(0), lse.unsqueeze(0)
    else:
        out_split = torch.empty(splits, num_q_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse_split = torch.empty(splits, num_q_tokens, num_heads, dtype=torch.float32, device=q.device)
    if num_q_tokens == 0 or plan.num_q_tiles == 0:
        if into is not None:
            into.out.zero_()
            into.lse.fill_(float("-inf"))
            return into
        if splits > 1:
            return AttentionState(out_split[0].to(out_dtype), lse_split[0])
        return AttentionState(out, lse)
    k_cache = kv_pool[0, layer, 0]
    v_cache = kv_pool[0, layer, 1]
    dummy = plan.kv_lens  # stands for pointers the kernel's constexpr branches never read
    causal = plan.q_pos is not None
    multi_row = plan.tile_seq is not None
    cfg = plan.config
    grid = (plan.num_q_tiles, plan.num_kv_heads, splits)
    micro_attention_kernel[grid](
        q, k_cache, v_cache,
        plan.block_tables, plan.kv_lens,
        plan.kv_start_pos if causal else dummy,
        plan.q_pos if causal else dummy,
        plan.query_start_loc,
        plan.tile_seq if multi_row else dummy,
        plan.tile_row if multi_row else dummy,
        out_split, lse_split,
        sm_scale * math.log2(math.e),
        plan.tiles_per_split,
        q.stride(0), q.stride(1),
        kv_pool.stride(0), kv_pool.stride(3), kv_pool.stride(4),
        plan.block_tables.stride(0),
        out_split.stride(0), out_split.stride(1), out_split.stride(2),
        lse_split.stride(0), lse_split.stride(1),
        QUERY_GROUP=num_heads // plan.num_kv_heads,
        GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.rows_per_tile,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
        BLOCK_SIZE=plan.block_size,
        TILE_N=cfg.tile_n,
        CAUSAL=causal,
        MULTI_ROW=multi_row,
        IEEE_DOT=q.dtype == torch.float32,
        DOT_IN_FP32=q.dtype == torch.bfloat16 and q.device.type != "cuda",
        WRITE_LSE=return_lse or splits > 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if splits == 1:
        return AttentionState(out, lse)
    return _merge_triton(out_split, lse_split, lse_is_log2=False, out_dtype=out_dtype,
                         write_lse=return_lse or into is not None, into=into)


def micro_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    kv_start_pos: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
    sm_scale: float | None = None,
    out_dtype: torch.dtype = torch.float32,
    max_query_len: int | None = None,
    max_kv_len: int | None = None,
    check_bounds: bool = True,
    backend: Backend = "auto",
    num_splits: int | None = None,
    config: MicroAttentionConfig | None = None,
) -> AttentionState:
    """Attention of query rows over the KV blocks of each sequence that this pool holds.

    Plans and runs in one call; an engine running many layers plans once per step with
    :func:`plan_micro_attention` and calls :func:`run_micro_attention` per layer.

    Args:
        q: ``[num_q_tokens, num_heads, head_dim]`` float16, bfloat16 or float32.
        kv_pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, q's dtype.
        layer: the layer whose K and V are read.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        kv_lens: ``[num_seqs]`` int32, keys held here per sequence.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query rows.
        kv_start_pos, q_pos, max_query_len, max_kv_len, check_bounds, backend, num_splits,
        config: see :func:`plan_micro_attention`.
        sm_scale, out_dtype: see :func:`run_micro_attention`.

    Returns:
        ``AttentionState(out [num_q_tokens, num_heads, head_dim],
        lse [num_q_tokens, num_heads] float32)``; lse is a natural log, ``-inf`` where a row saw
        no key (and out is zero there).
    """
    shape = _check_pool(kv_pool, layer)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a 3-D tensor [num_q_tokens, num_heads, head_dim]")
    plan = plan_micro_attention(
        block_tables, kv_lens, query_start_loc,
        num_heads=q.shape[1], num_kv_heads=shape.num_kv_heads, head_dim=q.shape[2],
        block_size=shape.block_size, num_blocks=shape.num_blocks,
        kv_start_pos=kv_start_pos, q_pos=q_pos, max_query_len=max_query_len, max_kv_len=max_kv_len,
        check_bounds=check_bounds, backend=backend, num_splits=num_splits, config=config,
    )
    if check_bounds and int(query_start_loc[-1]) != q.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(query_start_loc[-1])} but q has {q.shape[0]} rows")
    return run_micro_attention(plan, q, kv_pool, layer, sm_scale=sm_scale, out_dtype=out_dtype)


def _merge_triton(
    out_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    *,
    lse_is_log2: bool,
    out_dtype: torch.dtype,
    write_lse: bool,
    into: AttentionState | None = None,
) -> AttentionState:
    from .triton_kernels import merge_attention_states_kernel

    num_parts, num_tokens, num_heads, head_dim = out_parts.shape
    if into is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype, device=out_parts.device)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=out_parts.device)
    else:
        out, lse = into.out, into.lse
    if num_tokens == 0 or num_heads == 0:
        return AttentionState(out, lse)
    merge_attention_states_kernel[(num_tokens, num_heads)](
        out_parts, lse_parts, out, lse, num_parts,
        out_parts.stride(0), out_parts.stride(1), out_parts.stride(2),
        lse_parts.stride(0), lse_parts.stride(1), lse_parts.stride(2),
        out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
        PARTS_PER_ITER=min(16, _next_pow2(num_parts)),
        LSE_IS_LOG2=lse_is_log2,
        WRITE_LSE=write_lse,
        num_warps=1 if head_dim <= 64 else 2,
    )
    return AttentionState(out, lse)


def merge_attention_states(
    out_parts: torch.Tensor | Sequence[torch.Tensor],
    lse_parts: torch.Tensor | Sequence[torch.Tensor],
    *,
    lse_base: Literal["e", "2"] = "e",
    out_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> AttentionState:
    """Exact merge of P partial attention states over disjoint key sets (online softmax).

    Args:
        out_parts: ``[P, num_tokens, num_heads, head_dim]`` or a sequence of P tensors
            ``[num_tokens, num_heads, head_dim]``; each part normalised by its own denominator.
        lse_parts: ``[P, num_tokens, num_heads]`` or a sequence of P ``[num_tokens, num_heads]``;
            ``-inf`` marks an empty part, whose output is ignored.
        lse_base: ``"e"`` (this project's kernels) or ``"2"`` for base-2 log-sum-exp produced by
            an outside kernel.
        out_dtype: dtype of the merged output; default the parts' dtype.
        backend: "auto", "triton" or "torch".

    Returns:
        ``AttentionState(out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads]
        float32 natural log)``; ``-inf`` and a zero output where every part was empty.
    """
    if not isinstance(out_parts, torch.Tensor):
        out_parts = list(out_parts)
        if not out_parts:
            raise ValueError("merge_attention_states needs at least one part")
        _check_same_parts("out_parts", out_parts)
        out_parts = torch.stack(out_parts)
    if not isinstance(lse_parts, torch.Tensor):
        lse_parts = list(lse_parts)
        if not lse_parts:
            raise ValueError("merge_attention_states needs at least one part")
        _check_same_parts("lse_parts", lse_parts)
        lse_parts = torch.stack(lse_parts)
    if out_parts.dim() != 4:
        raise ValueError(f"out_parts must be [P, num_tokens, num_heads, head_dim], got shape {list(out_parts.shape)}")
    if tuple(lse_parts.shape) != tuple(out_parts.shape[:3]):
        raise ValueError(f"lse_parts shape {list(lse_parts.shape)} must be out_parts' first three dims {list(out_parts.shape[:3])}")
    if out_parts.shape[0] == 0:
        raise ValueError("merge_attention_states needs at least one part")
    if out_parts.dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"out_parts dtype must be float16, bfloat16 or float32, got {out_parts.dtype}")
    if lse_parts.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"lse_parts must be float32, got {lse_parts.dtype}")
    if out_parts.device != lse_parts.device:
        raise ValueError(f"out_parts ({out_parts.device}) and lse_parts ({lse_parts.device}) must be on one device")
    if lse_base not in ("e", "2"):
        raise ValueError(f"lse_base must be 'e' or '2', got {lse_base!r}")
    out_dtype = out_parts.dtype if out_dtype is None else out_dtype
    if out_dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    lse_is_log2 = lse_base == "2"
    if _resolve_backend(backend, out_parts.device) == "torch":
        return AttentionState(*merge_attention_states_torch(out_parts, lse_parts, lse_is_log2, out_dtype))
    if out_parts.stride(-1) != 1:
        out_parts = out_parts.contiguous()
    return _merge_triton(out_parts, lse_parts.float(), lse_is_log2=lse_is_log2, out_dtype=out_dtype, write_lse=True)


def merge_two_attention_states(
    a: AttentionState,
    b: AttentionState,
    *,
    out_dtype: torch.dtype,
    backend: Backend = "auto",
    with_lse: bool = False,
) -> torch.Tensor | AttentionState:
    """The merged output of two partial states of the same rows (a home's own part and one
    creditor's, the common decode case), read where each lies: one launch, no stacking.

    Args:
        a, b: ``AttentionState(out [num_tokens, num_heads, head_dim], lse [num_tokens, num_heads]
            float32 natural log)``; the two outs may differ in float dtype, each is contiguous in
            its last dimension; ``-inf`` marks an empty part.
        out_dtype: dtype of the merged output.
        with_lse: return the merged state, log-sum-exp included, for a merge with a further
            part (a row held by the home and several creditors).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` out_dtype: what :func:`merge_attention_states`
        returns for the parts ``[a, b]``; with ``with_lse``, ``AttentionState(out, lse
        [num_tokens, num_heads] float32)``.
    """
    if a.out.dim() != 3 or b.out.shape != a.out.shape:
        raise ValueError(f"the parts' outputs must share one shape [num_tokens, num_heads, head_dim], got "
                         f"{list(a.out.shape)} and {list(b.out.shape)}")
    for name, state in (("a", a), ("b", b)):
        if tuple(state.lse.shape) != tuple(a.out.shape[:2]) or state.lse.dtype != torch.float32:
            raise ValueError(f"{name}.lse must be float32 {list(a.out.shape[:2])}, got "
                             f"{state.lse.dtype} {list(state.lse.shape)}")
        if state.out.dtype not in _ATTENTION_DTYPES:
            raise ValueError(f"{name}.out dtype must be float16, bfloat16 or float32, got {state.out.dtype}")
        if state.out.device != a.out.device or state.lse.device != a.out.device:
            raise ValueError("both parts must be on one device")
    if out_dtype not in _ATTENTION_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if _resolve_backend(backend, a.out.device) == "torch":
        out, lse = merge_attention_states_torch(torch.stack([a.out.float(), b.out.float()]),
                                                torch.stack([a.lse, b.lse]), False, out_dtype)
        return AttentionState(out, lse) if with_lse else out
    from .triton_kernels import merge_two_states_kernel

    out_a, out_b, lse_a, lse_b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a.out, b.out, a.lse, b.lse))
    num_tokens, num_heads, head_dim = out_a.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=out_dtype, device=out_a.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=out_a.device) if with_lse else None
    if num_tokens > 0 and num_heads > 0:
        merge_two_states_kernel[(num_tokens, num_heads)](
            out_a, lse_a, out_b, lse_b, out, lse if with_lse else lse_a,
            out_a.stride(0), out_a.stride(1), lse_a.stride(0),
            out_b.stride(0), out_b.stride(1), lse_b.stride(0),
            out.stride(0), out.stride(1), lse.stride(0) if with_lse else 0,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(16, _next_pow2(head_dim)),
            WRITE_LSE=with_lse,
            num_warps=1 if head_dim <= 64 else 2,
        )
    return AttentionState(out, lse) if with_lse else out


def _check_same_parts(name: str, parts: list[torch.Tensor]) -> None:
    first = parts[0]
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            raise ValueError(f"{name}[{i}] must be a torch.Tensor, got {type(part).__name__}")
        if part.shape != first.shape or part.dtype != first.dtype or part.device != first.device:
            raise ValueError(
                f"{name}[{i}] is {list(part.shape)} {part.dtype} on {part.device}; "
                f"{name}[0] is {list(first.shape)} {first.dtype} on {first.device}"
            )


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    *,
    check_bounds: bool = True,
    backend: Backend = "auto",
) -> None:
    """Scatter new K and V rows into their block slots, in place.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the pool's dtype.
        kv_pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: the layer written.
        slot_mapping: ``[num_tokens]`` int32 or int64, ``block_id * block_size + offset``.
        check_bounds: check every slot lies in the pool (syncs with the device once).
        backend: "auto", "triton" or "torch".
    """
    shape = _check_pool(kv_pool, layer)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [num_tokens, num_kv_heads, head_dim]")
        if tuple(t.shape[1:]) != (shape.num_kv_heads, shape.head_dim):
            raise ValueError(
                f"{name} has {t.shape[1]} heads of dim {t.shape[2]}; the pool holds "
                f"{shape.num_kv_heads} KV heads of dim {shape.head_dim}"
            )
        if t.dtype != kv_pool.dtype:
            raise ValueError(f"{name} is {t.dtype} but kv_pool is {kv_pool.dtype}: they must match")
        if t.device != kv_pool.device:
            raise ValueError(f"{name} is on {t.device}, kv_pool on {kv_pool.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows, v has {v.shape[0]}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be an int32 or int64 tensor")
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping must have shape [{k.shape[0]}], got {list(slot_mapping.shape)}")
    if slot_mapping.device != kv_pool.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, kv_pool on {kv_pool.device}")
    num_slots = shape.num_blocks * shape.block_size
    if check_bounds and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slot_mapping holds slot {lo if lo < 0 else hi} outside the pool's [0, {num_slots})")
    if k.shape[0] == 0:
        return
    if _resolve_backend(backend, kv_pool.device) == "torch":
        write_kv_torch(k, v, kv_pool, layer, slot_mapping)
        return
    from .triton_kernels import write_kv_kernel

    write_kv_kernel[(k.shape[0],)](
        k, v, kv_pool[0, layer, 0], kv_pool[0, layer, 1], slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_pool.stride(0), kv_pool.stride(3), kv_pool.stride(4),
        NUM_KV_HEADS=shape.num_kv_heads,
        HEADS_PAD=_next_pow2(shape.num_kv_heads),
        HEAD_DIM=shape.head_dim,
        HEAD_DIM_PAD=_next_pow2(shape.head_dim),
        BLOCK_SIZE=shape.block_size,
        num_warps=1 if shape.num_kv_heads * shape.head_dim <= 512 else 4,
    )
