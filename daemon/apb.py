"""APB prefill across instances: the hosts' collectives over the transport, and one host's chunk.

A request asked for with ``prefill: "apb"`` is prefilled by H instances at once (the plan is
``apb_plan.py``; the algorithm ``engine/seq_parallel.py``). Each host computes its chunk's KV
straight into blocks of its own pool, reserved for the request as a move's are (``TryMoveKV``
on a peer, ``reserve_home_blocks`` on the home). Once every host is done, each peer's chunk is
the segment it holds for the request, committed in its ledger like a moved one, and the home
adopts them into the request's block table: decode then runs exact DistAttention over them.

The hosts meet per layer in an all-gather of their passing blocks: each sends its block to
every other host as an ``APBPassing`` (answered ``Ack`` once buffered), and waits for theirs in
an :class:`APBInbox`. Blocks may arrive before their host has begun (a fast peer), so the inbox
keeps them for a while for a prefill it does not know yet, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from infinite_llm.engine.model import LlamaModel
from infinite_llm.engine.seq_parallel import APBConfig, apb_prefill
from infinite_llm.transport.interface import PeerAddress, Transport
from infinite_llm.transport.kv_packing import wait_for_event
from infinite_llm.transport.messages import Ack, APBChunkPrefill, APBPassing

from . import failpoints

log = logging.getLogger(__name__)

# Prefills whose blocks came before they began here, kept at most this many at once and this
# long (a host that never begins, its home gone, leaves nothing behind for good).
MAX_EARLY_PREFILLS = 16
EARLY_BLOCKS_TTL_S = 60.0


class APBAborted(RuntimeError):
    """A host of the prefill did not do its part in time (or refused it): the prefill ends."""


@dataclass
class _Prefill:
    size: int  # hosts
    rank: int  # this host's
    num_rounds: int  # collectives the prefill makes: 1 + a layer's each, at most
    received: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (round, src) -> data
    failed: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set at each block or failure


class APBInbox:
    """Passing blocks received, per prefill ``(home_inst_id, req_id)``, until their host takes them."""

    def __init__(self, max_early: int = MAX_EARLY_PREFILLS, early_ttl_s: float = EARLY_BLOCKS_TTL_S) -> None:
        self._prefills: dict[tuple[int, int], _Prefill] = {}
        self._early: dict[tuple[int, int], dict[tuple[int, int], torch.Tensor]] = {}
        self._early_since: dict[tuple[int, int], float] = {}
        self._ended: dict[tuple[int, int], float] = {}  # prefills over here -> when, for as long as the TTL
        self._max_early = max_early
        self._early_ttl_s = early_ttl_s

    def begin(self, key: tuple[int, int], size: int, rank: int, num_rounds: int) -> None:
        """This host takes part in the prefill ``key``: blocks that came early become its."""
        if key in self._prefills:
            raise ValueError(f"APB prefill of request {key[1]} of instance {key[0]} is already under way here")
        prefill = _Prefill(size, rank, num_rounds)
        for (round_, src), data in self._early.pop(key, {}).items():
            if src < size and src != rank and round_ < num_rounds:
                prefill.received[(round_, src)] = data
        self._early_since.pop(key, None)
        self._prefills[key] = prefill

    def end(self, key: tuple[int, int]) -> None:
        """The prefill is over here (done or failed): what else comes for it is dropped."""
        if self._prefills.pop(key, None) is not None:
            self._ended[key] = time.monotonic()

    def put(self, message: APBPassing, now: float) -> Ack:
        """Buffer a host's block; ValueError (an error reply) for one no prefill here can take."""
        key = (message.home_inst_id, message.req_id)
        prefill = self._prefills.get(key)
        data = torch.as_tensor(message.data)
        if prefill is None:
            # Only a prefill's first round can come before this host begins it: no host sends
            # round r + 1 before it has this host's block of round r.
            if message.round != 0:
                raise ValueError(f"passing block of round {message.round} for request {message.req_id} of "
                                 f"instance {message.home_inst_id}: no such APB prefill here")
            self._drop_stale_early(now)
            if key in self._ended:  # a host late for a prefill that is over here: it would hold a slot
                raise ValueError(f"the APB prefill of request {message.req_id} of instance {message.home_inst_id} "
                                 "is over here")
            early = self._early.get(key)
            if early is None:
                if len(self._early) >= self._max_early:
                    raise ValueError(f"passing block for request {message.req_id} of instance "
                                     f"{message.home_inst_id}: no such APB prefill here, and "
                                     f"{self._max_early} others wait to begin")
                early = self._early[key] = {}
                self._early_since[key] = now
            if (message.round, message.src_rank) in early:
                raise ValueError(f"round {message.round} of host {message.src_rank} came twice")
            early[(message.round, message.src_rank)] = data
            return Ack()
        if message.src_rank >= prefill.size or message.src_rank == prefill.rank:
            raise ValueError(f"passing block from host {message.src_rank}: the prefill of request "
                             f"{message.req_id} has hosts 0..{prefill.size - 1}, this is host {prefill.rank}")
        if message.round >= prefill.num_rounds:
            raise ValueError(f"round {message.round}: the prefill makes {prefill.num_rounds}")
        if (message.round, message.src_rank) in prefill.received:
            raise ValueError(f"round {message.round} of host {message.src_rank} came twice")
        prefill.received[(message.round, message.src_rank)] = data
        prefill.changed.set()
        return Ack()

    def fail(self, key: tuple[int, int], why: str) -> None:
        """Wake this host's wait with ``APBAborted(why)`` (another host failed)."""
        prefill = self._prefills.get(key)
        if prefill is not None:
            prefill.failed = why
            prefill.changed.set()

    async def take(self, key: tuple[int, int], round_: int, sources: Sequence[int],
                   timeout_s: float) -> list[torch.Tensor]:
        """The blocks of ``round_`` from ``sources``, waited for at most ``timeout_s``."""
        prefill = self._prefills[key]
        wanted = [(round_, src) for src in sources]

        deadline = time.monotonic() + timeout_s
        while prefill.failed is None and not all(w in prefill.received for w in wanted):
            prefill.changed.clear()
            try:
                await asyncio.wait_for(prefill.changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                missing = [src for r, src in wanted if (r, src) not in prefill.received]
                raise APBAborted(f"hosts {missing} sent no passing block of round {round_} within "
                                 f"{timeout_s:.1f} s") from None
        if prefill.failed is not None:
            raise APBAborted(prefill.failed)
        return [prefill.received.pop(w) for w in wanted]

    @property
    def num_early(self) -> int:
        return len(self._early)

    def _drop_stale_early(self, now: float) -> None:
        for key, since in list(self._early_since.items()):
            if now - since > self._early_ttl_s:
                self._early.pop(key, None)
                self._early_since.pop(key, None)
        for key, since in list(self._ended.items()):
            if now - since > self._early_ttl_s:
                del self._ended[key]


class TransportHostGroup:
    """The hosts of one APB prefill as instances on the transport (a ``HostGroup``)."""

    def __init__(self, transport: Transport, inbox: APBInbox, key: tuple[int, int], rank: int,
                 addresses: Sequence[PeerAddress | None], device: torch.device, timeout_s: float) -> None:
        """``addresses``: each host's, in rank order (this host's is not used); ``timeout_s``:
        the longest a round waits for the others' blocks, and a send for its ``Ack``."""
        self.rank = rank
        self.size = len(addresses)
        self._transport = transport
        self._inbox = inbox
        self._key = key
        self._addresses = list(addresses)
        self._device = device
        self.timeout_s = timeout_s
        self._round = 0
        self.bytes_sent = 0

    async def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        round_ = self._round
        self._round += 1
        others = [r for r in range(self.size) if r != self.rank]
        data = tensor.contiguous()
        await self._send(round_, others, data)
        received = dict(zip(others, await self._inbox.take(self._key, round_, others, self.timeout_s)))
        parts = []
        for r in range(self.size):
            part = data if r == self.rank else received[r].to(self._device, non_blocking=True)
            if part.shape != data.shape or part.dtype != data.dtype:
                raise APBAborted(f"host {r} sent a block of {part.dtype} {list(part.shape)} in round {round_}, "
                                 f"this host's is {data.dtype} {list(data.shape)}")
            parts.append(part)
        return parts

    def start_ring_pass(self, tensor: torch.Tensor) -> Awaitable[torch.Tensor]:
        round_ = self._round
        self._round += 1
        data = tensor.contiguous()
        after, before = (self.rank + 1) % self.size, (self.rank - 1) % self.size

        async def received() -> torch.Tensor:
            await self._send(round_, [after], data)
            (part,) = await self._inbox.take(self._key, round_, [before], self.timeout_s)
            return part.to(self._device, non_blocking=True)
        return asyncio.ensure_future(received())

    async def _send(self, round_: int, ranks: list[int], data: torch.Tensor) -> None:
        home_inst_id, req_id = self._key
        message = APBPassing(home_inst_id, req_id, round_, self.rank, data)
        sends = [self._transport.request(self._addresses[r], message, timeout_s=self.timeout_s) for r in ranks]
        results = await asyncio.gather(*sends, return_exceptions=True)
        for r, result in zip(ranks, results):
            if isinstance(result, BaseException):
                raise APBAborted(f"passing block of round {round_} to host {r}: {result}") from result
        self.bytes_sent += data.numel() * data.element_size() * len(ranks)


@dataclass(frozen=True)
class ChunkResult:
    num_tokens: int
    passing_bytes: int
    compute_s: float


def chunk_slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int,
                       device: torch.device) -> torch.Tensor:
    """``[num_tokens]`` int64 slots (``block_id * block_size + offset``) of a chunk's tokens in
    its blocks, in token order."""
    positions = torch.arange(num_tokens)
    blocks = torch.tensor(list(block_ids), dtype=torch.int64)[positions // block_size]
    return (blocks * block_size + positions % block_size).to(device)


async def prefill_chunk(model: LlamaModel, group: TransportHostGroup, message: APBChunkPrefill,
                        pool: torch.Tensor, block_ids: Sequence[int], block_size: int,
                        before_layer: Callable[[int], None] | None = None) -> ChunkResult:
    """This host's chunk of an APB prefill, its K and V written into ``block_ids`` of ``pool``
    (``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``) as each layer makes
    them. ``before_layer(layer)``: called before each layer (the caller extends its hold on
    the blocks). Returns once the writes are done on the device."""
    from infinite_llm.kernels import write_kv

    if len(block_ids) * block_size < message.chunk_len:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} tokens hold no chunk of {message.chunk_len}")
    started = time.perf_counter()
    ids = torch.as_tensor(message.token_ids).to(torch.int64)
    anchor_prefix = message.anchor_len if message.rank else 0
    query = ids[anchor_prefix:anchor_prefix + message.query_len]
    chunk = ids[anchor_prefix + message.query_len:]
    anchor = ids[:anchor_prefix] if message.rank else chunk[:message.anchor_len]
    config = APBConfig(anchor_len=message.anchor_len, passing_len=message.passing_len,
                       pool_width=message.pool_width, observe_len=message.observe_len, scorer=message.scorer,
                       seed=message.seed)
    slots = chunk_slot_mapping(block_ids, block_size, message.chunk_len, pool.device)

    def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(k, v, pool, layer, slots, check_bounds=False)
        if layer + 1 < model.config.num_layers:
            failpoints.reached("apb.layer")
            if before_layer is not None:
                before_layer(layer + 1)

    failpoints.reached("apb.layer")
    if before_layer is not None:
        before_layer(0)
    await apb_prefill(model, group, chunk, anchor, query, config, kv_sink=write)
    if pool.device.type == "cuda":
        # The blocks are read by other streams (attend requests, mailbox steps) once committed.
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(pool.device))
        await wait_for_event(written, time.monotonic() + group.timeout_s)
    return ChunkResult(message.chunk_len, group.bytes_sent, time.perf_counter() - started)

