"""Triton code of the attention kernels, alone. Wrappers: ``attention.py``.

Base-2 arithmetic inside (``exp2``, scores scaled by ``log2(e)``); every log-sum-exp that
leaves a kernel is a natural logarithm.
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def micro_attention_kernel(
    q_ptr,  # [num_q_tokens, num_heads, head_dim]
    k_cache_ptr,  # kv_pool[0, layer, 0]: K of block b at + b * stride_block
    v_cache_ptr,  # kv_pool[0, layer, 1]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    kv_len_ptr,  # [num_seqs] int32: keys held here
    kv_start_pos_ptr,  # [num_seqs] int32: absolute position of the first key held here (CAUSAL)
    q_pos_ptr,  # [num_q_tokens] int32: absolute position of each query row (CAUSAL)
    query_start_loc_ptr,  # [num_seqs + 1] int32
    tile_seq_ptr,  # [num_q_tiles] int32: the sequence of each query tile (MULTI_ROW)
    tile_row_ptr,  # [num_q_tiles] int32: the first query row of each tile (MULTI_ROW)
    out_ptr,  # [num_splits, num_q_tokens, num_heads, head_dim]
    lse_ptr,  # [num_splits, num_q_tokens, num_heads] float32, natural log
    sm_scale_log2,  # softmax scale * log2(e)
    tiles_per_split,  # KV tiles of TILE_N keys handled by one program
    stride_q_tok,
    stride_q_head,
    stride_block,
    stride_tok,
    stride_kv_head,
    stride_bt,
    stride_o_split,
    stride_o_tok,
    stride_o_head,
    stride_l_split,
    stride_l_tok,
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # QUERY_GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query rows per program; BLOCK_Q * GROUP_PAD >= 16
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    TILE_N: tl.constexpr,  # keys per loop iteration
    CAUSAL: tl.constexpr,
    MULTI_ROW: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # exact fp32 products for fp32 inputs (no tf32)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: Triton's CPU interpreter has no bf16 dot
    WRITE_LSE: tl.constexpr,
):
    """One program: BLOCK_Q query rows x the query heads of one KV head x one split of the keys.

    Each KV head's keys are read once for its whole query group: the group's heads are the
    rows of the score tile, so GQA costs no extra KV traffic.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if MULTI_ROW:
        seq = tl.load(tile_seq_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
    else:
        seq = tile
        row0 = tl.load(query_start_loc_ptr + seq)
    row_end = tl.load(query_start_loc_ptr + seq + 1)

    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_row = row0 + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    row_valid = (q_row < row_end) & (head_in_group < QUERY_GROUP)
    q_head = kv_head * QUERY_GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q_row64 = q_row.to(tl.int64)
    q = tl.load(
        q_ptr + q_row64[:, None] * stride_q_tok + q_head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    kv_len = tl.load(kv_len_ptr + seq)
    if CAUSAL:
        kv_start = tl.load(kv_start_pos_ptr + seq)
        q_pos = tl.load(q_pos_ptr + q_row, mask=row_valid, other=-1)
        # Keys past the tile's last query position are masked for every row: skip them.
        kv_visible = tl.minimum(kv_len, tl.max(q_pos, axis=0) - kv_start + 1)
    else:
        kv_visible = kv_len
    kv_visible = tl.maximum(kv_visible, 0)
    num_tiles = tl.cdiv(kv_visible, TILE_N)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    head_offset = kv_head * stride_kv_head
    for kv_tile in range(tile_lo, tile_hi):
        n = kv_tile * TILE_N + offs_n
        n_valid = n < kv_visible
        block_id = tl.load(bt_row + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        key_offset = block_id * stride_block + (n % BLOCK_SIZE) * stride_tok + head_offset
        # k: [HEAD_DIM_PAD, TILE_N]
        k = tl.load(
            k_cache_ptr + key_offset[None, :] + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        if IEEE_DOT or DOT_IN_FP32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * sm_scale_log2
        visible = n_valid[None, :]
        if CAUSAL:
            visible = visible & ((kv_start + n)[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # v: [TILE_N, HEAD_DIM_PAD]
        v = tl.load(
            v_cache_ptr + key_offset[:, None] + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if DOT_IN_FP32:
            # Round p as the GPU path does, then multiply in fp32.
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        elif IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    out_offset = split.to(tl.int64) * stride_o_split + q_row64[:, None] * stride_o_tok
    tl.store(
        out_ptr + out_offset + q_head[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )
    if WRITE_LSE:
        tl.store(
            lse_ptr + split.to(tl.int64) * stride_l_split + q_row64 * stride_l_tok + q_head,
            lse,
            mask=row_valid,
        )


@triton.jit
def merge_attention_states_kernel(
    out_parts_ptr,  # [P, num_tokens, num_heads, head_dim]
    lse_parts_ptr,  # [P, num_tokens, num_heads]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    lse_ptr,  # [num_tokens, num_heads] float32, natural log
    num_parts,
    stride_op_part,
    stride_op_tok,
    stride_op_head,
    stride_lp_part,
    stride_lp_tok,
    stride_lp_head,
    stride_o_tok,
    stride_o_head,
    stride_l_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PARTS_PER_ITER: tl.constexpr,
    LSE_IS_LOG2: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """One program merges the P parts of one (token, head) row."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.arange(0, PARTS_PER_ITER)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    lse_row = lse_parts_ptr + tok * stride_lp_tok + head * stride_lp_head
    out_row = out_parts_ptr + tok * stride_op_tok + head * stride_op_head

    lse_max = float("-inf")
    for p0 in range(0, num_parts, PARTS_PER_ITER):
        part = p0 + offs_p
        lse = tl.load(lse_row + part * stride_lp_part, mask=part < num_parts, other=float("-inf"))
        lse_max = tl.maximum(lse_max, tl.max(lse.to(tl.float32), axis=0))
    if LSE_IS_LOG2:
        lse_max = lse_max * LN2
    safe_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    denom = 0.0
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for p0 in range(0, num_parts, PARTS_PER_ITER):
        part = p0 + offs_p
        lse = tl.load(lse_row + part * stride_lp_part, mask=part < num_parts, other=float("-inf"))
        lse = lse.to(tl.float32)
        if LSE_IS_LOG2:
            lse = lse * LN2
        weight = tl.exp(lse - safe_max)
        denom += tl.sum(weight, axis=0)
        # An empty part's output may be anything: never load it.
        nonempty = weight > 0.0
        o = tl.load(
            out_row + part[:, None].to(tl.int64) * stride_op_part + offs_d[None, :],
            mask=nonempty[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc += tl.sum(o.to(tl.float32) * weight[:, None], axis=0)

    seen = denom > 0.0
    out = acc / tl.where(seen, denom, 1.0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_valid,
    )
    if WRITE_LSE:
        lse_out = tl.where(seen, safe_max + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_l_tok + head, lse_out)


@triton.jit
def merge_two_states_kernel(
    out_a_ptr,  # [num_tokens, num_heads, head_dim]
    lse_a_ptr,  # [num_tokens, num_heads] float32
    out_b_ptr,  # [num_tokens, num_heads, head_dim], any float dtype
    lse_b_ptr,  # [num_tokens, num_heads] float32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    lse_ptr,  # [num_tokens, num_heads] float32, natural log (WRITE_LSE only)
    stride_oa_tok,
    stride_oa_head,
    stride_la_tok,
    stride_ob_tok,
    stride_ob_head,
    stride_lb_tok,
    stride_o_tok,
    stride_o_head,
    stride_l_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """One program merges the two parts of one (token, head) row: the home's own part and one
    creditor's, read where each lies (no stacking). The arithmetic of
    ``merge_attention_states_kernel`` for two parts, in the same order; with ``WRITE_LSE``
    the merged log-sum-exp too, so that merges chain (a part more per creditor)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    lse_a = tl.load(lse_a_ptr + tok * stride_la_tok + head).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + tok * stride_lb_tok + head).to(tl.float32)
    lse_max = tl.maximum(lse_a, lse_b)
    safe_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight_a = tl.exp(lse_a - safe_max)
    weight_b = tl.exp(lse_b - safe_max)
    denom = weight_a + weight_b
    o_a = tl.load(out_a_ptr + tok * stride_oa_tok + head * stride_oa_head + offs_d, mask=d_valid, other=0.0)
    o_b = tl.load(out_b_ptr + tok * stride_ob_tok + head * stride_ob_head + offs_d, mask=d_valid, other=0.0)
    # An empty part's output may be anything (NaN included): it is selected away, not weighted.
    o_a = tl.where(weight_a > 0.0, o_a.to(tl.float32), 0.0)
    o_b = tl.where(weight_b > 0.0, o_b.to(tl.float32), 0.0)
    acc = o_a * weight_a + o_b * weight_b
    seen = denom > 0.0
    out = acc / tl.where(seen, denom, 1.0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_valid)
    if WRITE_LSE:
        lse_out = tl.where(seen, safe_max + tl.log(tl.where(seen, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * stride_l_tok + head, lse_out)


@triton.jit
def write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # kv_pool[0, layer, 0]
    v_cache_ptr,  # kv_pool[0, layer, 1]
    slot_mapping_ptr,  # [num_tokens]: block_id * BLOCK_SIZE + offset
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_block,
    stride_tok,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program writes the K and V rows of one token, every KV head."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = block_id * stride_block + offset * stride_tok + offs_h[:, None] * stride_kv_head + offs_d[None, :]
    k = tl.load(k_ptr + tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
