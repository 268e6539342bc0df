"""Torch references of the attention kernels.

These are the CPU path of the wrappers in ``attention.py`` (vectorised per sequence) and the
oracle the Triton kernels are tested against. Arithmetic is float32 whatever the input dtype.
Log-sum-exp values are natural logarithms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Query rows per matmul in the reference: bounds the [rows, keys] score matrix of a long
# prefill chunk to a few hundred MB.
_ROWS_PER_CHUNK = 1024
# torch's fused CPU attention returns the log-sum-exp beside the output: several times faster
# than scores + logsumexp + exp + matmul. A private op, so its absence falls back to those.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def micro_attention_torch(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_start_pos: torch.Tensor | None,
    q_pos: torch.Tensor | None,
    sm_scale: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query rows over the KV blocks held in ``kv_pool``.

    Args:
        q: ``[num_q_tokens, num_heads, head_dim]``.
        kv_pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        layer: the layer whose K and V are read.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; row i lists the blocks of
            sequence i in token order.
        kv_lens: ``[num_seqs]`` int32, keys of each sequence held here.
        query_start_loc: ``[num_seqs + 1]`` int32; the rows of sequence i are
            ``q[query_start_loc[i]:query_start_loc[i + 1]]``.
        kv_start_pos: ``[num_seqs]`` int32, absolute position of the first key held here.
        q_pos: ``[num_q_tokens]`` int32 absolute positions, or None: every row sees every key.
        sm_scale: softmax scale.
        out_dtype: dtype of the returned output.

    Returns:
        ``out [num_q_tokens, num_heads, head_dim]`` in ``out_dtype`` and
        ``lse [num_q_tokens, num_heads]`` float32, natural log, ``-inf`` where a row saw no key
        (its output is zero).
    """
    num_q_tokens, num_heads, head_dim = q.shape
    _, _, _, block_size, num_kv_heads, _ = kv_pool.shape
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = kv_lens.tolist()
    if is_decode_batch(starts, lens, q_pos):
        gather = plan_decode_gather(block_tables, kv_lens, block_size, max(lens))
        return decode_attention_torch(q, kv_pool, layer, gather, sm_scale, out_dtype)
    out = torch.zeros(num_q_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_q_tokens, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    kv_starts = kv_start_pos.tolist() if kv_start_pos is not None else [0] * len(lens)
    for seq, num_keys in enumerate(lens):
        row_lo, row_hi = starts[seq], starts[seq + 1]
        if row_hi == row_lo or num_keys == 0:
            continue
        num_seq_blocks = -(-num_keys // block_size)
        blocks = block_tables[seq, :num_seq_blocks].long()
        # kv: [num_seq_blocks, 2, block_size, num_kv_heads, head_dim]
        kv = kv_pool[blocks, layer].float()
        # k, v: [num_kv_heads, num_keys, head_dim]
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:num_keys].transpose(0, 1)
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:num_keys].transpose(0, 1)
        for lo in range(row_lo, row_hi, _ROWS_PER_CHUNK):
            hi = min(lo + _ROWS_PER_CHUNK, row_hi)
            chunk_out, chunk_lse = _attend_rows(
                q[lo:hi], k, v, kv_starts[seq], None if q_pos is None else q_pos[lo:hi].long(), sm_scale, group
            )
            out[lo:hi] = chunk_out
            lse[lo:hi] = chunk_lse
    return out.to(out_dtype), lse


@dataclass(frozen=True)
class DecodeGather:
    """Where a decode batch's keys are in the pool: the same for every layer of a step.

    Built once per step by :func:`plan_decode_gather`, used per layer by
    :func:`decode_attention_torch`. Each sequence's keys are gathered into ``num_keys`` slots
    (whole blocks); the slots past its length are masked.
    """

    block_ids: torch.Tensor  # [num_seqs * num_cols] int64, block 0 in columns past a sequence's last block
    hidden_slots: torch.Tensor  # [num_hidden] int64, slots of the flattened [num_seqs * num_keys] past each end
    mask: torch.Tensor  # [num_seqs, 1, 1, num_keys] float32, 0 for a key, -inf past the end
    empty: torch.Tensor | None  # [num_seqs] bool, sequences with no key here; None: every one has keys
    num_seqs: int
    num_keys: int  # slots per sequence: num_cols * block_size


def is_decode_batch(query_start_loc: list[int], kv_lens: list[int], q_pos: torch.Tensor | None) -> bool:
    """One query row per sequence, no causal mask and at least one key: the batched decode path."""
    return (q_pos is None and bool(kv_lens) and max(kv_lens) > 0 and query_start_loc[-1] == len(kv_lens)
            and all(b - a == 1 for a, b in zip(query_start_loc, query_start_loc[1:])))


def plan_decode_gather(block_tables: torch.Tensor, kv_lens: torch.Tensor, block_size: int,
                       max_kv_len: int) -> DecodeGather:
    """Args: block_tables ``[num_seqs, max_blocks_per_seq]`` int32, kv_lens ``[num_seqs]`` int32,
    ``max_kv_len == max(kv_lens) > 0``."""
    device = block_tables.device
    num_seqs = block_tables.shape[0]
    num_cols = -(-max_kv_len // block_size)
    num_keys = num_cols * block_size
    lens = kv_lens.long()
    table = block_tables[:, :num_cols].long()
    # Columns past a sequence's last block may hold anything: read block 0 there, masked below.
    used = torch.arange(num_cols, device=device)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    block_ids = torch.where(used, table, torch.zeros_like(table)).flatten()
    hidden = torch.arange(num_keys, device=device)[None, :] >= lens[:, None]  # [num_seqs, num_keys]
    mask = torch.zeros(num_seqs, 1, 1, num_keys, device=device).masked_fill_(hidden[:, None, None, :], -math.inf)
    empty = lens == 0
    return DecodeGather(block_ids, hidden.flatten().nonzero().squeeze(1), mask,
                        empty if bool(empty.any()) else None, num_seqs, num_keys)


def decode_attention_torch(
    q: torch.Tensor, kv_pool: torch.Tensor, layer: int, gather: DecodeGather, sm_scale: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query row per sequence over its keys: every sequence in one call.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        kv_pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
        gather: the step's :class:`DecodeGather`.

    Returns:
        out ``[num_seqs, num_heads, head_dim]`` in ``out_dtype`` and lse ``[num_seqs, num_heads]``
        float32, natural log, ``-inf`` (with a zero output) for a sequence without keys.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[4]
    group = num_heads // num_kv_heads
    num_keys = gather.num_keys
    # One gather per K and V straight into [num_seqs, num_keys, num_kv_heads, head_dim]: each
    # block's slab of this layer is contiguous, so index_select copies whole slabs.
    k = kv_pool[:, layer, 0].index_select(0, gather.block_ids).view(num_seqs, num_keys, num_kv_heads, head_dim).float()
    v = kv_pool[:, layer, 1].index_select(0, gather.block_ids).view(num_seqs, num_keys, num_kv_heads, head_dim).float()
    # Slots past a sequence's end hold stale data (anything, NaN included), and a masked score
    # or a zero probability times NaN is still NaN: zero those slots in the gathered copies
    # (usually a few per sequence) so that the additive -inf mask removes them exactly.
    k.view(num_seqs * num_keys, -1).index_fill_(0, gather.hidden_slots, 0.0)
    v.view(num_seqs * num_keys, -1).index_fill_(0, gather.hidden_slots, 0.0)
    # The group's query heads share their KV head, and with one row per sequence they are the
    # rows of one attention over that head: q [S, Hkv, group, D] against k, v [S, Hkv, N, D].
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(qg, k, v, 0.0, False, attn_mask=gather.mask, scale=sm_scale)
    else:
        scores = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale + gather.mask  # [S, Hkv, group, N]
        lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        out = torch.matmul(torch.exp(scores - safe[..., None]), v)
    out = out.reshape(num_seqs, num_heads, head_dim)  # from [S, Hkv, group, D]
    lse = lse.reshape(num_seqs, num_heads)
    if gather.empty is not None:
        # No key here: zero output, -inf lse (the fused kernel leaves NaN there).
        out = out.masked_fill(gather.empty[:, None, None], 0.0)
        lse = lse.masked_fill(gather.empty[:, None], -math.inf)
    return out.to(out_dtype), lse


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_start: int,
    q_pos: torch.Tensor | None,
    sm_scale: float,
    group: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``q [num_rows, num_heads, head_dim]`` over ``k, v [num_kv_heads, num_keys, head_dim]``
    (float32) whose first key is at ``kv_start``. Returns out ``[num_rows, num_heads, head_dim]``
    and lse ``[num_rows, num_heads]``, natural log."""
    num_rows, num_heads, head_dim = q.shape
    num_keys = k.shape[1]
    visible = None
    fused = _FLASH_CPU is not None and q.device.type == "cpu"
    square_causal = False
    if q_pos is not None:
        # Keys past the last row's position are masked for every row: leave them out.
        num_keys = max(0, min(num_keys, int(q_pos.max()) - kv_start + 1))
        k, v = k[:, :num_keys], v[:, :num_keys]
        key_pos = kv_start + torch.arange(num_keys, device=q.device)
        # A prompt's first chunk: row i is at key i's position. The fused kernel's own causal
        # mask (row i sees keys <= i) is then this mask exactly, with nothing to build per layer.
        square_causal = fused and num_rows == num_keys and bool((q_pos == key_pos).all())
        if not square_causal:
            visible = key_pos[None, :] <= q_pos[:, None]  # [num_rows, num_keys]
    if num_keys == 0:
        return (torch.zeros(num_rows, num_heads, head_dim, device=q.device),
                torch.full((num_rows, num_heads), -math.inf, device=q.device))
    q32 = q.float().transpose(0, 1)  # [num_heads, num_rows, head_dim]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    if fused:
        mask = None if visible is None else torch.where(visible, 0.0, -math.inf)[None, None]
        out, lse = _FLASH_CPU(q32[None], k[None], v[None], 0.0, square_causal, attn_mask=mask, scale=sm_scale)
        out, lse = out[0], lse[0]  # [num_heads, num_rows, head_dim], [num_heads, num_rows]
    else:
        scores = torch.matmul(q32, k.transpose(1, 2)) * sm_scale
        if visible is not None:
            scores = scores.masked_fill(~visible, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        out = torch.matmul(torch.exp(scores - safe_lse[..., None]), v)
    if visible is not None:
        # Rows that see no key: zero output, -inf lse (the fused kernel leaves NaN there).
        blind = ~visible.any(dim=1)
        if bool(blind.any()):
            out = out.masked_fill(blind[None, :, None], 0.0)
            lse = lse.masked_fill(blind[None, :], -math.inf)
    return out.transpose(0, 1), lse.transpose(0, 1)


def merge_attention_states_torch(
    out_parts: torch.Tensor, lse_parts: torch.Tensor, lse_is_log2: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of P partial attention states.

    Args:
        out_parts: ``[P, num_tokens, num_heads, head_dim]``, each part normalised by its own
            softmax denominator.
        lse_parts: ``[P, num_tokens, num_heads]``; natural log, or base 2 if ``lse_is_log2``;
            ``-inf`` marks an empty part (its output is ignored).
        lse_is_log2: whether ``lse_parts`` are base-2 logarithms.
        out_dtype: dtype of the merged output.

    Returns:
        ``out [num_tokens, num_heads, head_dim]`` and ``lse [num_tokens, num_heads]`` float32,
        natural log, ``-inf`` (with a zero output) where every part was empty.
    """
    lse = lse_parts.float()
    if lse_is_log2:
        lse = lse * math.log(2.0)
    lse_max = lse.amax(dim=0)
    safe_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse - safe_max)  # [P, num_tokens, num_heads]; zero for empty parts
    denom = weights.sum(dim=0)
    parts = torch.where(weights[..., None] > 0, out_parts.float(), torch.zeros((), device=out_parts.device))
    out = (weights[..., None] * parts).sum(dim=0) / torch.where(denom > 0, denom, 1.0)[..., None]
    merged_lse = torch.where(denom > 0, safe_max + torch.log(denom), torch.full_like(denom, -math.inf))
    return out.to(out_dtype), merged_lse


def write_kv_torch(
    k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: int, slot_mapping: torch.Tensor
) -> None:
    """Scatter K and V rows into their slots: ``slot = block_id * block_size + offset``.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        kv_pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` integer slots.
    """
    block_ids, offsets = split_slots(slot_mapping, kv_pool.shape[3])
    write_kv_at_torch(k, v, kv_pool, layer, block_ids, offsets)


def split_slots(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_mapping ``[num_tokens]`` -> (block ids, offsets in the block), both ``[num_tokens]`` int64."""
    slots = slot_mapping.long()
    return slots // block_size, slots % block_size


def write_kv_at_torch(k: torch.Tensor, v: torch.Tensor, kv_pool: torch.Tensor, layer: int,
                      block_ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """:func:`write_kv_torch` with the slots already split by :func:`split_slots` (once per step)."""
    kv_pool[block_ids, layer, 0, offsets] = k.to(kv_pool.dtype)
    kv_pool[block_ids, layer, 1, offsets] = v.to(kv_pool.dtype)
