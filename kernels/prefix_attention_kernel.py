"""Triton code of the prefix + causal attention of APB prefill, alone. Wrapper and torch
reference: ``prefix_attention.py``.

Imported lazily by the wrapper, like ``triton_kernels.py``: ``infinite_llm.kernels`` must import
on a CPU machine without Triton, and under ``TRITON_INTERPRET=1`` the interpreter has to be on
before ``@triton.jit`` runs.

Base-2 arithmetic inside (``exp2``, scores scaled by ``log2(e)``); the log-sum-exp written out
is a natural logarithm.
"""

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)

# Launch shapes tried on CUDA, per head_dim and dtype (the autotune key): the usual
# flash-attention forward tiles on an H100. A 128 x 128 tile of head_dim 128 fits shared memory
# with two stages, not three.
CUDA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
]


@triton.jit
def _attend_key_range(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] float32, un-normalised output
    l_i,  # [BLOCK_M] float32, softmax denominator
    m_i,  # [BLOCK_M] float32, running max of the base-2 scores
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    k_ptrs,  # [HEAD_DIM_PAD, BLOCK_N] pointers to the keys key_lo .. key_lo + BLOCK_N - 1
    v_ptrs,  # [BLOCK_N, HEAD_DIM_PAD], the same keys
    stride_k_tok,
    stride_v_tok,
    sm_scale_log2,
    key_lo,  # first key, a multiple of BLOCK_N
    key_hi,  # one past the last key read
    last_key,  # [BLOCK_M]: the last key each row sees (MASKED)
    offs_n,
    d_valid,
    MASKED: tl.constexpr,  # False: every row sees every key of [key_lo, key_hi), which are whole blocks
    PAD_HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Online softmax of the rows of ``q`` over the keys ``[key_lo, key_hi)``."""
    for start_n in range(key_lo, key_hi, BLOCK_N):
        keys = start_n + offs_n
        if MASKED:
            in_range = keys < key_hi
            k = tl.load(k_ptrs, mask=in_range[None, :] & d_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=in_range[:, None] & d_valid[None, :], other=0.0)
        elif PAD_HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if DOT_IN_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        elif IEEE_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if MASKED:
            s = s * sm_scale_log2
            # Keys past key_hi lie past every valid row's last key, so this one test also hides
            # the zeros loaded there. No row reaches a block with m_i = -inf and nothing
            # visible (each sees key 0, or has seen the unmasked keys first): no NaN guard.
            s = tl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # The scale is positive, so max(s) * scale is max(s * scale) exactly, and the
            # scaling folds into one multiply-add per score.
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * sm_scale_log2)
            p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # Rescale first, then let the matmul accumulate into acc in place (on Hopper, wgmma
        # adds into the accumulator's registers: no second [BLOCK_M, HEAD_DIM_PAD] tile).
        acc = acc * alpha[:, None]
        if DOT_IN_FP32:
            # Round p as the GPU path does, then multiply in fp32.
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
        elif IEEE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_k_tok
        v_ptrs += BLOCK_N * stride_v_tok
    return acc, l_i, m_i


@triton.jit
def prefix_causal_attention_kernel(
    q_ptr,  # [num_rows, num_heads, head_dim]
    k_ptr,  # [prefix_len + num_rows, num_kv_heads, head_dim]
    v_ptr,  # [prefix_len + num_rows, num_kv_heads, head_dim]
    out_ptr,  # [num_rows, num_heads, head_dim], q's dtype
    lse_ptr,  # [num_rows, num_heads] float32, natural log
    sm_scale_log2,  # softmax scale * log2(e)
    num_rows,
    prefix_len,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_l_tok,
    QUERY_GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
    IEEE_DOT: tl.constexpr,  # exact fp32 products for fp32 inputs (no tf32)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: Triton's CPU interpreter has no bf16 dot
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
):
    """One program: BLOCK_M query rows of one query head.

    Row i sees keys ``0 .. prefix_len + i``: the whole prefix, then its chunk causally. Keys up
    to the block's first row's last key are seen by every row of the block, so all the whole
    key blocks below that run without a mask; the few blocks across the diagonal run masked;
    the blocks above it are never read.
    """
    # Launch the last row blocks first: they see the most keys, and the launch's tail is short.
    row_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERY_GROUP
    first_row = row_block * BLOCK_M
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_valid = offs_m < num_rows
    d_valid = offs_d < HEAD_DIM
    offs_m64 = offs_m.to(tl.int64)

    q = tl.load(
        q_ptr + offs_m64[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    # k_ptrs: [HEAD_DIM_PAD, BLOCK_N] (K transposed), v_ptrs: [BLOCK_N, HEAD_DIM_PAD], at key 0.
    k_ptrs = k_ptr + kv_head * stride_k_head + offs_n.to(tl.int64)[None, :] * stride_k_tok + offs_d[:, None]
    v_ptrs = v_ptr + kv_head * stride_v_head + offs_n.to(tl.int64)[:, None] * stride_v_tok + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    last_key = prefix_len + offs_m
    # Every row of the block sees keys 0 .. prefix_len + first_row.
    unmasked_hi = ((prefix_len + first_row + 1) // BLOCK_N) * BLOCK_N
    key_hi = prefix_len + tl.minimum(first_row + BLOCK_M, num_rows)
    acc, l_i, m_i = _attend_key_range(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_k_tok, stride_v_tok, sm_scale_log2,
        0, unmasked_hi, last_key, offs_n, d_valid,
        MASKED=False, PAD_HEAD_DIM=HEAD_DIM != HEAD_DIM_PAD, BLOCK_N=BLOCK_N,
        IEEE_DOT=IEEE_DOT, DOT_IN_FP32=DOT_IN_FP32,
    )
    acc, l_i, m_i = _attend_key_range(
        acc, l_i, m_i, q,
        k_ptrs + unmasked_hi.to(tl.int64) * stride_k_tok, v_ptrs + unmasked_hi.to(tl.int64) * stride_v_tok,
        stride_k_tok, stride_v_tok, sm_scale_log2, unmasked_hi, key_hi, last_key, offs_n, d_valid,
        MASKED=True, PAD_HEAD_DIM=HEAD_DIM != HEAD_DIM_PAD, BLOCK_N=BLOCK_N,
        IEEE_DOT=IEEE_DOT, DOT_IN_FP32=DOT_IN_FP32,
    )

    # Every valid row saw at least its own key: l_i > 0 there.
    l_safe = tl.where(row_valid, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * LN2
    tl.store(
        out_ptr + offs_m64[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )
    tl.store(lse_ptr + offs_m64 * stride_l_tok + head, lse, mask=row_valid)


prefix_causal_attention_autotuned = triton.autotune(
    configs=CUDA_CONFIGS, key=["HEAD_DIM_PAD", "QUERY_GROUP", "IEEE_DOT"]
)(prefix_causal_attention_kernel)


# --- the same attention, its tiles moved by tensor descriptors (TMA on Hopper) ----------------
#
# On sm_90 a descriptor load is one TMA copy of a whole tile into shared memory, issued by one
# thread and pipelined over num_stages buffers, where the pointer kernel above has every thread
# compute addresses and issue its own loads. The wrapper takes this kernel where the layouts
# allow it (heads of one token contiguous, head_dim a power of two; see
# ``prefix_attention._descriptor_layout_ok``). Descriptors index 2-D views: q and out as
# ``[rows, num_heads * head_dim]``, k and v as ``[keys, num_kv_heads * head_dim]``; a tile is
# ``[BLOCK, HEAD_DIM]`` at column ``head * HEAD_DIM``. Rows past a view's end load as zeros and
# are never stored.

CUDA_DESCRIPTOR_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
]


@triton.jit
def _attend_key_range_desc(
    acc, l_i, m_i, q,  # as in _attend_key_range
    k_desc, v_desc,  # [keys, num_kv_heads * HEAD_DIM] descriptors, block [BLOCK_N, HEAD_DIM]
    kv_col,  # kv_head * HEAD_DIM
    sm_scale_log2,
    key_lo, key_hi, last_key, offs_n,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Online softmax of the rows of ``q`` over the keys ``[key_lo, key_hi)``."""
    for start_n in range(key_lo, key_hi, BLOCK_N):
        k = k_desc.load([start_n, kv_col])  # [BLOCK_N, HEAD_DIM]
        v = v_desc.load([start_n, kv_col])
        if DOT_IN_FP32:
            s = tl.dot(q, k.to(tl.float32).T, input_precision="ieee")
        else:
            s = tl.dot(q, k.T)
        if MASKED:
            s = s * sm_scale_log2
            # Keys past key_hi (loaded as zeros past the view's end, or as the next rows of k)
            # lie past every valid row's last key: this one test hides them.
            s = tl.where((start_n + offs_n)[None, :] <= last_key[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * sm_scale_log2)
            p = tl.exp2(s * sm_scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if DOT_IN_FP32:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def prefix_causal_attention_desc_kernel(
    q_desc,  # [num_rows, num_heads * HEAD_DIM], block [BLOCK_M, HEAD_DIM]
    k_desc,  # [prefix_len + num_rows, num_kv_heads * HEAD_DIM], block [BLOCK_N, HEAD_DIM]
    v_desc,  # as k_desc
    o_desc,  # as q_desc, q's dtype
    lse_ptr,  # [num_rows, num_heads] float32, natural log
    sm_scale_log2,
    num_rows,
    prefix_len,
    stride_l_tok,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # a power of two >= 16
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: Triton's CPU interpreter has no bf16 dot
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one query head, as ``prefix_causal_attention_kernel``."""
    row_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_col = (head // QUERY_GROUP) * HEAD_DIM
    first_row = row_block * BLOCK_M
    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)

    q = q_desc.load([first_row, head * HEAD_DIM])
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last_key = prefix_len + offs_m
    unmasked_hi = ((prefix_len + first_row + 1) // BLOCK_N) * BLOCK_N
    key_hi = prefix_len + tl.minimum(first_row + BLOCK_M, num_rows)
    acc, l_i, m_i = _attend_key_range_desc(
        acc, l_i, m_i, q, k_desc, v_desc, kv_col, sm_scale_log2, 0, unmasked_hi, last_key, offs_n,
        MASKED=False, BLOCK_N=BLOCK_N, DOT_IN_FP32=DOT_IN_FP32,
    )
    acc, l_i, m_i = _attend_key_range_desc(
        acc, l_i, m_i, q, k_desc, v_desc, kv_col, sm_scale_log2, unmasked_hi, key_hi, last_key, offs_n,
        MASKED=True, BLOCK_N=BLOCK_N, DOT_IN_FP32=DOT_IN_FP32,
    )

    row_valid = offs_m < num_rows
    l_safe = tl.where(row_valid, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) * LN2
    o_desc.store([first_row, head * HEAD_DIM], out.to(o_desc.dtype))
    tl.store(lse_ptr + offs_m.to(tl.int64) * stride_l_tok + head, lse, mask=row_valid)


def _set_descriptor_blocks(nargs: dict) -> None:
    """Autotune hook: the descriptors' block shapes follow the config being tried."""
    block_m, block_n, head_dim = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["q_desc"].block_shape = [block_m, head_dim]
    nargs["o_desc"].block_shape = [block_m, head_dim]
    nargs["k_desc"].block_shape = [block_n, head_dim]
    nargs["v_desc"].block_shape = [block_n, head_dim]


for _config in CUDA_DESCRIPTOR_CONFIGS:
    _config.pre_hook = _set_descriptor_blocks

prefix_causal_attention_desc_autotuned = triton.autotune(
    configs=CUDA_DESCRIPTOR_CONFIGS, key=["HEAD_DIM", "QUERY_GROUP", "DOT_IN_FP32"]
)(prefix_causal_attention_desc_kernel)
