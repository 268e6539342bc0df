"""Torch references of the attention kernels.

These are the CPU path of the wrappers in ``attention.py`` (vectorised per sequence) and the
oracle the Triton kernels are tested against. Arithmetic is float32 whatever the input dtype.
Log-sum-exp values are natural logarithms.
"""

from __future__ import annotations

import math

import torch

# Query rows per matmul in the reference: bounds the [rows, keys] score matrix of a long
# prefill chunk to a few hundred MB.
_ROWS_PER_CHUNK = 1024


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
    out = torch.zeros(num_q_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_q_tokens, num_heads), -math.inf, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    lens = kv_lens.tolist()
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
        key_pos = kv_starts[seq] + torch.arange(num_keys, device=q.device)
        for lo in range(row_lo, row_hi, _ROWS_PER_CHUNK):
            hi = min(lo + _ROWS_PER_CHUNK, row_hi)
            num_rows = hi - lo
            # qg: [num_kv_heads, group * num_rows, head_dim], rows grouped per KV head
            qg = q[lo:hi].float().view(num_rows, num_kv_heads, group, head_dim)
            qg = qg.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_rows, head_dim)
            scores = torch.bmm(qg, k.transpose(1, 2)) * sm_scale
            if q_pos is not None:
                visible = key_pos[None, :] <= q_pos[lo:hi].long()[:, None]  # [num_rows, num_keys]
                scores = scores.view(num_kv_heads, group, num_rows, num_keys)
                scores = scores.masked_fill(~visible, -math.inf).view(num_kv_heads, -1, num_keys)
            row_lse = torch.logsumexp(scores, dim=-1)  # [num_kv_heads, group * num_rows]
            safe_lse = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
            probs = torch.exp(scores - safe_lse[..., None])
            row_out = torch.bmm(probs, v)  # [num_kv_heads, group * num_rows, head_dim]
            out[lo:hi] = row_out.view(num_kv_heads, group, num_rows, head_dim).permute(2, 0, 1, 3).reshape(
                num_rows, num_heads, head_dim
            )
            lse[lo:hi] = row_lse.view(num_kv_heads, group, num_rows).permute(2, 0, 1).reshape(num_rows, num_heads)
    return out.to(out_dtype), lse


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
    block_size = kv_pool.shape[3]
    slots = slot_mapping.long()
    block_ids = slots // block_size
    offsets = slots % block_size
    kv_pool[block_ids, layer, 0, offsets] = k.to(kv_pool.dtype)
    kv_pool[block_ids, layer, 1, offsets] = v.to(kv_pool.dtype)
