"""Prefill of one long prompt over several hosts: APB (approximate, fast) and ring (exact).

Each host (one instance, one GPU) runs every layer on its own rows of the prompt and keeps the
K and V it makes: they are the request's segments on that host, and decode then runs exact
DistAttention over them. What differs is what a host's rows attend to.

**APB** (anchor block plus passing blocks, arXiv 2502.12085): the document is cut into H
contiguous chunks, one per host, of about equal length (they may differ: one all-gather of the
lengths before layer 0 gives every host its true positions). Every host but the first puts an
*anchor block*, the document's first ``anchor_len`` tokens, before its chunk, and every host puts
the query rows (the question that follows the document, rotated at its positions after the
document; they only score, see below). Per layer:

- the anchor block attends causally to itself;
- each host scores its chunk's keys by the attention its query rows (or, with no query, its
  last ``observe_len`` chunk rows) pay them, max-pooled over ``pool_width`` neighbours, and
  keeps the ``passing_len`` best per KV head: its *passing block*. Host 0 never passes its
  first ``anchor_len`` keys, which the later hosts hold already as their anchor block, so its
  block may be shorter; it is zero-padded for the all-gather and the padding cut off again;
- the passing blocks are all-gathered;
- the chunk's rows attend to the anchor block's document keys and the passing blocks of the
  hosts before this one (no mask: all are earlier), and causally to their own chunk: on CUDA in
  one launch of ``kernels.prefix_causal_attention``, elsewhere as two attentions merged by
  log-sum-exp.

So a host's attention is about its own chunk's, and only ``passing_len`` keys per host cross
the wire per layer. Every earlier key is seen at most once; with ``passing_len`` at least the
longest chunk nothing is dropped and APB is exact prefill, whatever ``anchor_len`` (the tests
hold it to that).

**Ring** (RingAttention with the zigzag layout of context-parallel training): the prompt is cut
into 2H chunks and host r holds chunks r and 2H-1-r, which balances the causal work. Each
layer's K and V travel around the ring in H-1 passes, overlapped with the attention over the
part in hand. Exact.

Hosts talk through a :class:`HostGroup`: :class:`LocalHostGroup` runs H hosts as coroutines of
one process (tests); ``TorchHostGroup`` uses ``torch.distributed`` (NCCL between GPUs, gloo on
the CPU).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from infinite_llm.kernels import AttentionState, merge_attention_states, prefix_causal_attention

from .model import LlamaModel

# --- hosts -----------------------------------------------------------------------------------


class HostGroup(Protocol):
    rank: int  # this host, 0-based
    size: int  # hosts

    async def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every host's ``tensor`` (all of one shape and dtype), in host order."""
        ...

    def start_ring_pass(self, tensor: torch.Tensor) -> Awaitable[torch.Tensor]:
        """Send ``tensor`` to host ``rank + 1`` and receive host ``rank - 1``'s (same shape),
        both modulo ``size``. The transfer starts now; await the result for the received one."""
        ...


class LocalHostGroup:
    """H hosts as coroutines of one process, for tests: tensors are handed over, not copied."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        self.rank = rank
        self.size = size
        self._shared = shared
        self._rounds = {"gather": 0, "ring": 0}

    @classmethod
    def create(cls, size: int) -> list[LocalHostGroup]:
        shared: dict = {"slots": {}, "changed": asyncio.Condition()}
        return [cls(rank, size, shared) for rank in range(size)]

    async def _put_and_take(self, kind: str, put_to: list[int], tensor: torch.Tensor,
                            take_from: list[int]) -> list[torch.Tensor]:
        round_ = self._rounds[kind]
        self._rounds[kind] += 1
        slots, changed = self._shared["slots"], self._shared["changed"]
        async with changed:
            for dst in put_to:
                slots[(kind, round_, self.rank, dst)] = tensor
            changed.notify_all()
            keys = [(kind, round_, src, self.rank) for src in take_from]
            await asyncio.wait_for(changed.wait_for(lambda: all(k in slots for k in keys)), timeout=60)
            return [slots.pop(k) for k in keys]

    async def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        everyone = list(range(self.size))
        return await self._put_and_take("gather", everyone, tensor, everyone)

    def start_ring_pass(self, tensor: torch.Tensor) -> Awaitable[torch.Tensor]:
        coroutine = self._put_and_take("ring", [(self.rank + 1) % self.size], tensor, [(self.rank - 1) % self.size])
        task = asyncio.ensure_future(coroutine)

        async def received() -> torch.Tensor:
            return (await task)[0]
        return received()


class TorchHostGroup:
    """Hosts as the ranks of a ``torch.distributed`` process group (one process per host).

    On NCCL the collectives are queued on NCCL's stream and the compute stream waits for them,
    so a ring pass overlaps with the attention queued before it is awaited.
    """

    def __init__(self, group=None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]

    async def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._dist.all_gather(parts, tensor.contiguous(), group=self._group)
        return parts

    def start_ring_pass(self, tensor: torch.Tensor) -> Awaitable[torch.Tensor]:
        dist = self._dist
        incoming = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor.contiguous(), self._global[(self.rank + 1) % self.size], group=self._group),
            dist.P2POp(dist.irecv, incoming, self._global[(self.rank - 1) % self.size], group=self._group),
        ])

        async def received() -> torch.Tensor:
            for work in works:
                work.wait()
            return incoming
        return received()


# --- attention over contiguous K and V -------------------------------------------------------


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                       sm_scale: float) -> AttentionState:
    """Flash attention of ``q [n, heads, head_dim]`` over ``k, v [m, kv_heads, head_dim]``.

    ``causal``: row i sees keys 0..i (rows and keys at the same positions, so n == m).

    Returns ``AttentionState(out [n, heads, head_dim] in q's dtype, lse [n, heads] float32,
    natural log)``; rows that see no key (m == 0) get a zero output and ``-inf``.

    Raises ValueError when k and v differ in shape, when head_dim differs from q's, or when
    ``heads`` is not a multiple of ``kv_heads`` (the kernel would read past the last KV head).
    """
    n, num_heads, head_dim = q.shape
    m, num_kv_heads, k_head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim}, k and v have {k_head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if causal and n != m:
        raise ValueError(f"causal attention needs as many keys as rows, got {n} rows and {m} keys")
    if m == 0 or n == 0:
        return AttentionState(torch.zeros_like(q), torch.full((n, num_heads), float("-inf"), device=q.device))
    group = num_heads // num_kv_heads
    # [1, heads, tokens, head_dim] views; the flash kernels take equal head counts.
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    v4 = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q4, k4, v4, 0.0, causal, False,
                                                                       scale=sm_scale)[:2]
    elif q.device.type == "cuda":
        # The flash kernel takes 16-bit inputs only; the memory-efficient one also float32. Its
        # log-sum-exp rows are padded (to a multiple of 32).
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q4, k4, v4, None, True, 0.0, causal,
                                                                           scale=sm_scale)[:2]
        lse = lse[..., :n]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal,
                                                                               scale=sm_scale)
    return AttentionState(out[0].transpose(0, 1), lse[0].transpose(0, 1).float())


def _merge(parts: list[AttentionState], dtype: torch.dtype) -> torch.Tensor:
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return parts[0].out.to(dtype)
    return merge_attention_states([p.out.float() for p in parts], [p.lse for p in parts], out_dtype=dtype).out


# --- APB -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class APBConfig:
    anchor_len: int  # document tokens at the head of every host's rows but the first's
    passing_len: int  # keys per KV head each host passes to the later hosts, per layer (0: none)
    observe_len: int = 32  # with no query rows: the chunk's last rows that score its keys
    pool_width: int = 7  # scores are max-pooled over this many neighbouring keys (odd)
    # "attention": keys ranked by the attention the scoring rows pay them (APB's own);
    # "random": a random choice of as many keys, the ablation baseline of the accuracy bench.
    scorer: str = "attention"
    seed: int = 0  # the random scorer's seed (with the layer and host, one choice each)

    def __post_init__(self) -> None:
        if self.anchor_len < 0:
            raise ValueError(f"anchor_len must be >= 0, got {self.anchor_len}")
        if self.passing_len < 0:
            raise ValueError(f"passing_len must be >= 0, got {self.passing_len}")
        if self.scorer not in ("attention", "random"):
            raise ValueError(f"scorer must be 'attention' or 'random', got {self.scorer!r}")
        if self.observe_len <= 0:
            raise ValueError(f"observe_len must be > 0, got {self.observe_len}")
        if self.pool_width <= 0 or self.pool_width % 2 == 0:
            raise ValueError(f"pool_width must be a positive odd number, got {self.pool_width}")


@dataclass
class HostPrefill:
    """What one host keeps after prefilling its rows.

    kv: per layer, ``(k, v)`` each ``[num_rows, num_kv_heads, head_dim]`` and contiguous (not
        views of the projection's output, which would keep it alive), the host's own rows
        (positions in ``positions``): the request's segment(s) on this host.
    positions: ``[num_rows]`` int64, the absolute positions of those rows.
    hidden: ``[num_rows, hidden]``, the residual stream after the last layer.
    """

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    hidden: torch.Tensor


def passing_block(k: torch.Tensor, v: torch.Tensor, score_q: torch.Tensor, score_pos: torch.Tensor,
                  key_pos: torch.Tensor, config: APBConfig, sm_scale: float, *,
                  first_candidate: int = 0, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``passing_len`` keys of a chunk that its scoring rows attend to most, per KV head.

    Args:
        k, v: ``[n, kv_heads, head_dim]``, the chunk's keys and values.
        score_q: ``[s, heads, head_dim]``, the scoring rows' queries.
        score_pos, key_pos: ``[s]`` and ``[n]`` positions; a scoring row sees keys at positions
            up to its own (all of them, for query rows that follow the chunk).
        first_candidate: keys ``[:first_candidate]`` take part in the softmax but are never
            passed (host 0's anchor tokens: every later host holds them already, as its anchor
            block, and would count them twice).
        generator: with ``config.scorer == "random"``, the CPU generator that draws the keys.

    Returns:
        ``(k, v)`` each ``[min(passing_len, n - first_candidate), kv_heads, head_dim]``, per head
        in position order.
    """
    n, kv_heads, head_dim = k.shape
    if not 0 <= first_candidate <= n:
        raise ValueError(f"first_candidate must be in [0, {n}], got {first_candidate}")
    num_candidates = n - first_candidate
    keep = min(config.passing_len, num_candidates)
    if keep == num_candidates:
        return k[first_candidate:], v[first_candidate:]
    if config.scorer == "random":
        drawn = torch.stack([torch.randperm(num_candidates, generator=generator)[:keep] for _ in range(kv_heads)])
        chosen = drawn.sort(dim=-1).values.to(k.device) + first_candidate  # [kv_heads, keep]
        index = chosen.t().unsqueeze(-1).expand(keep, kv_heads, head_dim)
        return k.gather(0, index), v.gather(0, index)
    group = score_q.shape[1] // kv_heads
    # [kv_heads, group * s, head_dim] x [kv_heads, head_dim, n]: probabilities of every scoring row.
    q = score_q.float().view(-1, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, head_dim)
    logits = torch.bmm(q, k.float().permute(1, 2, 0)) * sm_scale
    visible = key_pos.view(1, n) <= score_pos.view(-1, 1)  # [s, n]
    logits = logits.view(kv_heads, group, -1, n).masked_fill(~visible, float("-inf"))
    # Cut the non-candidates off before pooling, so that a heavily attended anchor key (the
    # first tokens often are) does not lift the candidates next to it.
    scores = logits.softmax(dim=-1).sum(dim=(1, 2))[:, first_candidate:]  # [kv_heads, num_candidates]
    if config.pool_width > 1:
        scores = F.max_pool1d(scores.unsqueeze(1), config.pool_width, stride=1, padding=config.pool_width // 2).squeeze(1)
    chosen = scores.topk(keep, dim=-1).indices.sort(dim=-1).values + first_candidate  # [kv_heads, keep]
    index = chosen.t().unsqueeze(-1).expand(keep, kv_heads, head_dim)
    return k.gather(0, index), v.gather(0, index)


# Rows of one output projection and MLP call in a long prefill (as a chunked prefill's step).
MLP_ROWS = 8192


def _post_attention_in_slices(model: LlamaModel, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor,
                              rows: int) -> torch.Tensor:
    """``model.post_attention`` over ``rows`` rows at a time (each row's result depends on that
    row alone): hidden ``[n, hidden]``, attn_out ``[n, heads, head_dim]`` -> ``[n, hidden]``."""
    n = hidden.shape[0]
    if n <= rows:
        return model.post_attention(layer, hidden, attn_out)
    out = torch.empty_like(hidden)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        out[start:end] = model.post_attention(layer, hidden[start:end], attn_out[start:end])
    return out


async def apb_prefill(model: LlamaModel, group: HostGroup, chunk_ids: torch.Tensor, anchor_ids: torch.Tensor,
                      query_ids: torch.Tensor, config: APBConfig,
                      kv_sink: Callable[[int, torch.Tensor, torch.Tensor], object] | None = None,
                      mlp_rows: int = MLP_ROWS) -> HostPrefill:
    """Prefill this host's chunk of the document with APB.

    Args:
        model: the same weights on every host.
        group: the hosts; host r holds chunk r, the document's tokens after hosts 0..r-1's.
        chunk_ids: ``[chunk_len]`` int64, this host's chunk, not empty. The hosts' lengths may
            differ (a document that does not split evenly); host 0's must hold the anchor.
        anchor_ids: ``[anchor_len]`` int64, the document's first tokens (unused on host 0,
            whose chunk begins with them).
        query_ids: ``[query_len]`` int64, the question after the document (may be empty); its
            rows sit at positions ``doc_len ... doc_len + query_len - 1``, ``doc_len`` being all
            chunks' tokens together.
        config: anchor and passing lengths.
        kv_sink: if given, called as ``kv_sink(layer, k, v)`` with each layer's chunk K and V
            (``[chunk_len, kv_heads, head_dim]``, views that live until the next layer) instead
            of keeping them: a server writes them into its KV pool as they are made, and
            ``HostPrefill.kv`` is then empty.
        mlp_rows: the output projection and MLP run over this many rows at a time, so that a
            chunk of 64K rows does not need its ``[rows, 2 * intermediate]`` activations at once
            (4.7 GB at Llama-3-8B shapes; two hosts sharing a GPU need it twice).

    Returns:
        The host's :class:`HostPrefill` for its chunk rows (positions ``chunk_start ...
        chunk_start + chunk_len - 1``, ``chunk_start`` the tokens of the hosts before it).

    Raises:
        ValueError: ``anchor_ids`` is not ``anchor_len`` long; or some host's chunk is empty, or
            ``anchor_len`` is longer than host 0's chunk (raised on every host alike).
    """
    if anchor_ids.shape[0] != config.anchor_len:
        raise ValueError(f"anchor_ids has {anchor_ids.shape[0]} tokens, config.anchor_len is {config.anchor_len}")
    device = model.device
    c = model.config
    chunk_len = chunk_ids.shape[0]
    # One small all-gather before layer 0: each host learns where its chunk starts and how long
    # the others' passing blocks are, and the checks below fail on every host at once instead of
    # leaving the others waiting in a collective.
    chunk_lens = [int(n) for n in torch.cat(await group.all_gather(torch.tensor([chunk_len], device=device))).tolist()]
    if min(chunk_lens) == 0:
        raise ValueError(f"every host needs a non-empty chunk of the document, got chunk lengths {chunk_lens}")
    if config.anchor_len > chunk_lens[0]:
        raise ValueError(f"anchor_len ({config.anchor_len}) is longer than host 0's chunk ({chunk_lens[0]}), "
                         "which must hold the anchor")
    chunk_start = sum(chunk_lens[:group.rank])
    doc_len = sum(chunk_lens)
    # Host 0's chunk begins with the anchor tokens, which every later host holds as its anchor
    # block: host 0 does not pass them, or those hosts would count them twice.
    first_candidate = [config.anchor_len] + [0] * (group.size - 1)
    pass_lens = [min(config.passing_len, n - skip) for n, skip in zip(chunk_lens, first_candidate)]
    pass_width = max(pass_lens)  # all_gather takes one shape: shorter blocks are zero-padded to it
    # The random scorer draws on the CPU, the same keys whatever the device, one stream per host.
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + group.rank) if config.scorer == "random" else None

    anchor_len = config.anchor_len if group.rank > 0 else 0
    query_len = query_ids.shape[0]
    block_len = anchor_len + query_len  # the anchor block's rows: anchor document tokens, then query
    ids = torch.cat([anchor_ids[:anchor_len], query_ids, chunk_ids]).to(device)
    # Every row is rotated at its true position, the query rows after the whole document; the
    # anchor block's positions rise with its rows, so a plain causal mask over it stays right.
    positions = torch.cat([torch.arange(anchor_len), torch.arange(doc_len, doc_len + query_len),
                           torch.arange(chunk_start, chunk_start + chunk_len)]).to(device)
    local_pos = positions[block_len:]
    if query_len:
        score_rows = slice(anchor_len, block_len)
    else:
        observe = min(config.observe_len, chunk_len)
        score_rows = slice(block_len + chunk_len - observe, block_len + chunk_len)
    score_pos = positions[score_rows]

    hidden = model.embed(ids)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(c.num_layers):
        q, k, v = model.pre_attention(layer, hidden, positions)
        k_local, v_local = k[block_len:], v[block_len:]
        if pass_width:
            k_pass, v_pass = passing_block(k_local, v_local, q[score_rows], score_pos, local_pos, config,
                                           model.sm_scale, first_candidate=first_candidate[group.rank],
                                           generator=generator)
            # sent: [2 (k, v), pass_width, kv_heads, head_dim], rows past pass_lens[rank] zero.
            sent = F.pad(torch.stack([k_pass, v_pass]), (0, 0, 0, 0, 0, pass_width - k_pass.shape[0]))
            gathered = await group.all_gather(sent)
            # The padding is cut off here, so it never takes part in the attention.
            earlier = [block[:, :n] for block, n in zip(gathered[:group.rank], pass_lens)]
        else:
            earlier = []  # no passing blocks: each host sees the anchor and its own chunk only
        prefix_k = torch.cat([k[:anchor_len], *(g[0] for g in earlier)])
        prefix_v = torch.cat([v[:anchor_len], *(g[1] for g in earlier)])
        block_out = attention_with_lse(q[:block_len], k[:block_len], v[:block_len], causal=True,
                                       sm_scale=model.sm_scale).out
        if device.type == "cuda":
            # One Triton launch over [prefix; chunk] keys: the prefix unmasked, the chunk causal.
            chunk_out = prefix_causal_attention(q[block_len:], torch.cat([prefix_k, k_local]),
                                                torch.cat([prefix_v, v_local]), prefix_len=prefix_k.shape[0],
                                                sm_scale=model.sm_scale).out
        else:
            parts = [attention_with_lse(q[block_len:], k_local, v_local, causal=True, sm_scale=model.sm_scale)]
            if prefix_k.shape[0]:
                parts.append(attention_with_lse(q[block_len:], prefix_k, prefix_v, causal=False,
                                                sm_scale=model.sm_scale))
            chunk_out = _merge(parts, q.dtype)
        attn_out = torch.cat([block_out, chunk_out])
        del q, k, v, block_out, chunk_out
        hidden = _post_attention_in_slices(model, layer, hidden, attn_out, mlp_rows)
        if kv_sink is None:
            kept.append((k_local.contiguous(), v_local.contiguous()))
        else:
            kv_sink(layer, k_local, v_local)
    return HostPrefill(kept, local_pos, hidden[block_len:])


# --- ring ------------------------------------------------------------------------------------


def zigzag_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two of ``2 * size`` equal chunks that host ``rank`` holds."""
    return rank, 2 * size - 1 - rank


async def ring_prefill(model: LlamaModel, group: HostGroup, prompt_ids: torch.Tensor) -> HostPrefill:
    """Exact prefill of ``prompt_ids`` (``[num_tokens]``, every host gets the whole prompt and
    takes its zigzag chunks; ``num_tokens`` a multiple of ``2 * size``)."""
    size, rank = group.size, group.rank
    num_tokens = prompt_ids.shape[0]
    if num_tokens == 0 or num_tokens % (2 * size):
        raise ValueError(f"the prompt ({num_tokens} tokens) must be a positive multiple of 2 * hosts ({2 * size})")
    device = model.device
    chunk = num_tokens // (2 * size)
    mine = zigzag_chunks(rank, size)
    positions = torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in mine]).to(device)
    hidden = model.embed(prompt_ids.to(device)[positions])
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(model.config.num_layers):
        q, k, v = model.pre_attention(layer, hidden, positions)
        held = torch.stack([k, v])  # [2, 2 * chunk, kv_heads, head_dim]
        parts: list[list[AttentionState]] = [[], []]  # per own chunk
        for round_ in range(size):
            source = (rank - round_) % size
            passing = group.start_ring_pass(held) if round_ < size - 1 else None
            for i, own_chunk in enumerate(mine):
                rows = q[i * chunk:(i + 1) * chunk]
                for j, their_chunk in enumerate(zigzag_chunks(source, size)):
                    if their_chunk > own_chunk:
                        continue  # later tokens: masked out whole
                    keys = slice(j * chunk, (j + 1) * chunk)
                    parts[i].append(attention_with_lse(rows, held[0, keys], held[1, keys],
                                                       causal=their_chunk == own_chunk, sm_scale=model.sm_scale))
            if passing is not None:
                held = await passing
        attn_out = torch.cat([_merge(p, q.dtype) for p in parts])
        hidden = model.post_attention(layer, hidden, attn_out)
        kept.append((k, v.contiguous()))
    return HostPrefill(kept, positions, hidden)


async def exact_prefill(model: LlamaModel, prompt_ids: torch.Tensor) -> HostPrefill:
    """The whole prompt on one host: causal flash attention over all of it."""
    device = model.device
    positions = torch.arange(prompt_ids.shape[0], device=device)
    hidden = model.embed(prompt_ids.to(device))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(model.config.num_layers):
        q, k, v = model.pre_attention(layer, hidden, positions)
        out = attention_with_lse(q, k, v, causal=True, sm_scale=model.sm_scale).out
        hidden = model.post_attention(layer, hidden, out)
        kept.append((k, v.contiguous()))
    return HostPrefill(kept, positions, hidden)


async def extend_prefill(model: LlamaModel, past_kv: list[tuple[torch.Tensor, torch.Tensor]],
                         ids: torch.Tensor) -> HostPrefill:
    """Exact prefill of ``ids`` (``[n]`` int64) after a context whose KV is ``past_kv``.

    ``past_kv``: per layer ``(k, v)`` each ``[p, kv_heads, head_dim]``, the context's tokens at
    positions ``0 .. p - 1`` in order (the hosts' chunks of an APB or ring prefill, concatenated).
    The new rows sit at positions ``p .. p + n - 1``, attend to the whole context and causally
    to each other. Returns their :class:`HostPrefill` (``kv``: the new rows' K and V only); a
    reference for what the serving path computes through DistAttention, and what the accuracy
    bench decodes with.
    """
    device = model.device
    past_len = past_kv[0][0].shape[0] if past_kv else 0
    positions = torch.arange(past_len, past_len + ids.shape[0], device=device)
    hidden = model.embed(ids.to(device))
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(model.config.num_layers):
        q, k, v = model.pre_attention(layer, hidden, positions)
        parts = [attention_with_lse(q, k, v, causal=True, sm_scale=model.sm_scale)]
        if past_len:
            parts.append(attention_with_lse(q, past_kv[layer][0], past_kv[layer][1], causal=False,
                                            sm_scale=model.sm_scale))
        hidden = model.post_attention(layer, hidden, _merge(parts, q.dtype))
        kept.append((k.contiguous(), v.contiguous()))
    return HostPrefill(kept, positions, hidden)
