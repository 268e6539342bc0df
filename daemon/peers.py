"""The home side of DistAttention across daemons: remote attention and KV moves over a transport.

Moves are driven by the request's home, the only one that may switch its block table: from its
own pool to a peer (:meth:`TransportLender.move`), and from one peer to another
(:meth:`TransportLender.move_held`, whose data the holding peer sends with
:func:`forward_segment`).

Three id spaces meet here, each translated in one place:

* instance ids: the cluster's (config ``instance_id``, on the wire) and the engine's (its own
  pool is 0; :class:`PeerDirectory` gives each peer an engine id 1, 2, ... on first use);
* request ids: the engine's strings are the decimal form of the wire's integers;
* segment ids: a segment held by a peer is named by its first block, ``token_start // block_size``,
  which never changes while the segment exists.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from infinite_llm.engine.block_manager import BlockManager, OutOfBlocks, Segment, SegmentMove
from infinite_llm.engine.dist_attention import AttendBatch, RemoteAttention
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.kernels import AttentionState
from infinite_llm.transport import wire_trace
from infinite_llm.transport.errors import RemoteError, TransportError
from infinite_llm.transport.interface import PeerAddress, Transport
from infinite_llm.transport.kv_packing import HostStaging, KVPacker
from infinite_llm.transport.messages import (
    AttendRequest,
    AttendResult,
    AttendSlice,
    AuditHeld,
    AuditHeldReply,
    ForwardSegment,
    FreeSegment,
    HoldKV,
    KVBlocks,
    KVBlocksStored,
    MAX_AUDITED_SEGMENTS,
    HeldSegmentRef,
    KVHoldReply,
    Message,
    MoveCommit,
    MoveRejected,
    MoveRejectReason,
    MoveReserved,
    TryMoveKV,
)

from .ledger import CreditorLedger
from . import failpoints
from .metrics import InstanceMetrics

log = logging.getLogger(__name__)


@dataclass
class Peer:
    inst_id: int  # cluster id
    engine_id: int  # the id the engine's tables use for this peer's pool
    address: PeerAddress
    num_blocks_free: int  # last known, blocks
    draining: bool = False
    num_blocks_total: int = 0  # its pool, blocks
    quarantined_until: float = 0.0  # time.monotonic(): lost lately, lent nothing before then
    # In the membership at its last reading. One that left (stopped, or its lease or record
    # expired) keeps its entry, for the segments that name its engine id, but takes no block:
    # its last published free blocks are not room anyone has.
    in_membership: bool = True


# Blocks an idle instance does not publish as free for others: the padding block of its CUDA
# graphs and the block its own next step keeps (``InstanceDaemon._free_for_others``).
IDLE_PEER_KEEPS_BLOCKS = 2


class PeerDirectory:
    """The peers this instance knows, with their addresses and last known free blocks."""

    def __init__(self, own_inst_id: int) -> None:
        self.own_inst_id = own_inst_id
        self._by_inst: dict[int, Peer] = {}
        self._by_engine: dict[int, Peer] = {}
        self._next_engine_id = itertools.count(1)

    def update(self, inst_id: int, address: PeerAddress, num_blocks_free: int, draining: bool,
               num_blocks_total: int = 0) -> Peer:
        if inst_id == self.own_inst_id:
            raise ValueError("an instance is not its own peer")
        peer = self._by_inst.get(inst_id)
        if peer is None:
            peer = Peer(inst_id, next(self._next_engine_id), address, num_blocks_free, draining, num_blocks_total)
            self._by_inst[inst_id] = peer
            self._by_engine[peer.engine_id] = peer
        else:
            peer.address, peer.num_blocks_free, peer.draining = address, num_blocks_free, draining
            peer.num_blocks_total = num_blocks_total
        peer.in_membership = True
        return peer

    def retain_members(self, member_ids: set[int]) -> list[int]:
        """The membership now lists ``member_ids``: every other peer counts as gone (it takes no
        block, and no room is counted on it) until it is listed again. Returns the ids of the
        peers found gone by this reading."""
        left = []
        for peer in self._by_inst.values():
            present = peer.inst_id in member_ids
            if peer.in_membership and not present:
                left.append(peer.inst_id)
            peer.in_membership = present
        return left

    def by_inst(self, inst_id: int) -> Peer:
        return self._by_inst[inst_id]

    def quarantine(self, inst_id: int, until: float) -> None:
        """A peer lost with the KV it held (its parts failed): no block is lent to it, nor
        counted on it, before ``until`` (time.monotonic()), or before it restarts. Its entry in
        the membership may outlive it by a lease; a move to it would fail meanwhile."""
        peer = self._by_inst.get(inst_id)
        if peer is not None:
            peer.quarantined_until = until

    def end_quarantine(self, inst_id: int) -> None:
        """The peer restarted: it may take blocks again."""
        peer = self._by_inst.get(inst_id)
        if peer is not None:
            peer.quarantined_until = 0.0

    def _usable(self) -> list[Peer]:
        """Peers that may take blocks: in the membership, not draining, not quarantined."""
        now = time.monotonic()
        return [p for p in self._by_inst.values()
                if p.in_membership and not p.draining and p.quarantined_until <= now]

    def by_engine(self, engine_id: int) -> Peer:
        return self._by_engine[engine_id]

    def cluster_id(self, engine_id: int) -> int:
        """The cluster id of an engine instance id (0 is this instance)."""
        return self.own_inst_id if engine_id == 0 else self._by_engine[engine_id].inst_id

    def creditors(self, room: Callable[[Peer], int | tuple[int, ...]] | None = None) -> list[Peer]:
        """Peers that may take blocks (not draining), the most ``room`` first (default: their
        free blocks), the lower instance id first among equals."""
        room = room or (lambda p: p.num_blocks_free)
        return sorted(self._usable(), key=lambda p: (room(p), -p.inst_id), reverse=True)

    def num_free_blocks(self) -> int:
        return sum(p.num_blocks_free for p in self._usable())

    def num_lendable_capacity(self) -> int:
        """The most the peers that are not draining could lend, blocks: their pools less what an
        idle instance keeps for itself (``IDLE_PEER_KEEPS_BLOCKS``), so that a request admitted
        on this capacity can start once the peers are idle."""
        return sum(max(p.num_blocks_total - IDLE_PEER_KEEPS_BLOCKS, p.num_blocks_free) for p in self._usable())


_ATTEND_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _attend_result_problem(result: Message, request: AttendRequest) -> str | None:
    """What is wrong with a creditor's answer to ``request`` (None: nothing): its ids, the shape
    of its rows (one per query row, as many heads, the same head size), its dtypes, and (where it
    lies on the host, at no cost) NaN in its log-sum-exp. A bad part merged would be garbage in
    every row of those requests, or an error that ends every running request."""
    if not isinstance(result, AttendResult):
        return f"answered an attend request with {type(result).__name__}"
    if (result.step_id, result.layer, result.creditor_inst_id) != (request.step_id, request.layer,
                                                                  request.creditor_inst_id):
        return (f"answered step {result.step_id} layer {result.layer} (from {result.creditor_inst_id}) "
                f"for step {request.step_id} layer {request.layer}")
    out, lse = torch.as_tensor(result.out), torch.as_tensor(result.lse)
    if tuple(out.shape) != tuple(request.q.shape):
        return f"answered rows of shape {tuple(out.shape)} for queries of {tuple(request.q.shape)}"
    if out.dtype not in _ATTEND_OUT_DTYPES:
        return f"answered an output of {out.dtype}"
    if not lse.is_cuda and bool(torch.isnan(lse).any()):
        return "answered a log-sum-exp with NaN"
    return None


class PeerPartFailed(Exception):
    """A creditor's part of a step's attention did not come: the step did not complete.

    Nothing of the step was kept (tokens count as computed only after a step), so the same
    step may run again; the requests with KV on ``inst_id`` are the ones that cannot go on if
    the peer stays away.
    """

    def __init__(self, inst_id: int, engine_id: int, error: Exception) -> None:
        super().__init__(f"instance {inst_id}: {error}")
        self.inst_id = inst_id
        self.engine_id = engine_id
        self.error = error


class TransportRemoteAttention(RemoteAttention):
    """Sends one ``AttendRequest`` per creditor per layer and returns its partial state."""

    def __init__(self, transport: Transport, peers: PeerDirectory, block_size: int, metrics: InstanceMetrics,
                 timeout_s: float) -> None:
        self.transport = transport
        self.peers = peers
        self.block_size = block_size
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._slices: dict[tuple[int, int], tuple[AttendSlice, ...]] = {}  # (step, engine id) -> slices

    def _slices_of(self, batch: AttendBatch) -> tuple[AttendSlice, ...]:
        key = (batch.step_id, batch.instance_id)
        if key not in self._slices:
            # From the batch's host copy of its layout: its tensors are on the device, and reading
            # them back would wait for the step's queued kernels.
            self._slices[key] = tuple(
                AttendSlice(int(request_id), first_row, num_rows, token_start // self.block_size, num_keys)
                for (request_id, token_start), (first_row, num_rows, num_keys) in zip(batch.entry_keys,
                                                                                    batch.entry_rows)
            )
        return self._slices[key]

    async def attend(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> AttentionState:
        return await self.start(batch, layer, q, sm_scale)

    def start(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> Awaitable[AttentionState]:
        """The request leaves now (on an open connection): the creditor computes while this
        instance computes its own part, before the step's next await."""
        peer = self.peers.by_engine(batch.instance_id)
        started = time.perf_counter()
        wire_trace.record("attend.start", AttendRequest.TYPE)
        request = AttendRequest(self.peers.own_inst_id, peer.inst_id, batch.step_id, layer, self._slices_of(batch),
                                q.contiguous())
        wire_trace.record("attend.built", AttendRequest.TYPE)
        reply = self.transport.request_soon(peer.address, request, timeout_s=self.timeout_s)
        # A task, not a bare coroutine: a step that fails before it awaits this part can cancel
        # it, and the reply's bookkeeping in the transport ends with it.
        return asyncio.ensure_future(self._finish(peer, reply, started, request))

    async def _finish(self, peer: Peer, reply: Awaitable[Message], started: float,
                      request: AttendRequest) -> AttentionState:
        try:
            result = await reply
        except TransportError as exc:
            raise PeerPartFailed(peer.inst_id, peer.engine_id, exc) from exc
        self.metrics.observe_remote_wait(time.perf_counter() - started)
        problem = _attend_result_problem(result, request)
        if problem is not None:
            # The peer's part is unusable: as if it had not come (only its requests may end).
            log.error("instance %d: %s", peer.inst_id, problem)
            raise PeerPartFailed(peer.inst_id, peer.engine_id, ValueError(problem))
        wire_trace.record("attend.resumed", AttendResult.TYPE)
        device = request.q.device
        # The creditor's dtype is kept: the merge reads it as it is. Up to the device without
        # waiting for its stream: the result's host tensors are this reply's own, and a copy
        # from pageable memory has its bytes staged before it returns; the merge that reads
        # them is queued behind it on the same stream.
        out = torch.as_tensor(result.out).to(device=device, non_blocking=True)
        lse = torch.as_tensor(result.lse).to(device=device, dtype=torch.float32, non_blocking=True)
        wire_trace.record("attend.landed", AttendResult.TYPE)
        return AttentionState(out, lse)

    def end_step(self, step_id: int) -> None:
        for key in [k for k in self._slices if k[0] == step_id]:
            del self._slices[key]


# A move travels in pieces of at most this many bytes: each piece's transfer stays well inside
# the creditor's reservation time, and a step boundary comes between pieces.
MOVE_PIECE_BYTES = 256 << 20
# The slowest transfer a move's data request allows for, on top of the peer request timeout.
MOVE_BYTES_PER_S_FLOOR = 1e9
# Pauses before a FreeSegment is sent again after it could not be sent, s: a peer busy in a
# long step, or restarting, is reached within them; one gone for good frees nothing anyway.
FREE_RETRY_PAUSES_S = (0.5, 2.0, 5.0, 10.0, 20.0)

# A request whose holds were refused asks again after about this long, s (randomised).
HOLD_RETRY_S = 0.5


def move_piece_blocks(block_nbytes: int) -> int:
    """Blocks of ``block_nbytes`` in one piece of a move (at least one)."""
    return max(1, MOVE_PIECE_BYTES // block_nbytes)


class TransportLender:
    """Moves running requests' oldest blocks to peers, in two phases (reserve, send, commit)."""

    def __init__(self, transport: Transport, peers: PeerDirectory, metrics: InstanceMetrics,
                 timeout_s: float, share_kv: bool = True) -> None:
        self.transport = transport
        self.share_kv = share_kv  # False: no spill, and admission counts the home pool only
        self.peers = peers
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.engine: LLMEngine | None = None
        self.run_id = 0  # this process's run, named in its holds and reservations (0: not said)
        self._move_ids = itertools.count(1)
        self._background: set[asyncio.Task] = set()
        # Requests with a move of home blocks between its reservation and its switch: a second
        # move of the same request would find no block left to lend once its reservation came.
        self._moving: set[str] = set()
        # Creditor-to-creditor moves under way, (request, token_start, destination engine id):
        # the destination may hold the committed copy before the table points there.
        self._relocating: set[tuple[str, int, int]] = set()
        self._relocating_requests: set[str] = set()  # requests with a move_held under way
        # Gathers of scattered home blocks: a host pool's into buffers used again move after
        # move, in the transport's shared memory where it has some (sent to a local peer with no
        # copy); a device pool's with an event to poll, so that a move waits for the engine's
        # queued kernels without blocking the event loop.
        self._packer = KVPacker(HostStaging(allocate=transport.shared_host_buffer))
        # Blocks peers keep for a waiting request of this home (request -> peer inst id ->
        # blocks), asked for before it starts on their memory; its spills use them up.
        self._holds: dict[str, dict[int, int]] = {}
        self._asking: set[str] = set()  # requests whose holds are being asked for
        # Requests that ended while their holds were being asked for: the ask gives back what
        # it is granted (``forget`` saw none of it).
        self._ended_while_asking: set[str] = set()
        self._ask_again_at: dict[str, float] = {}  # after holds were refused: not before then
        # A peer lets a hold go once its time there (``timeouts.kv_hold_s``) has run out: the
        # holds this home still counts on are renewed every ``hold_renew_s`` (the instance makes
        # it a third of that time), as long as they last.
        self.hold_renew_s = 100.0
        # request -> peer inst id -> when its hold there was last set or renewed
        self._holds_set_at: dict[str, dict[int, float]] = {}
        self._renewing: set[tuple[str, int]] = set()  # (request, peer) renewals under way
        self.kept_for_others: Callable[[], int] = lambda: 0  # this pool's blocks other homes hold
        self.wake: Callable[[], None] = lambda: None  # the engine loop, when holds come

    # ---- KVLender -------------------------------------------------------------------------
    def num_home_blocks_kept_for_others(self) -> int:
        return self.kept_for_others()

    def blocks_kept_elsewhere(self, request_id: str, wanted: int) -> int:
        """Blocks the peers keep for the waiting request; when fewer than ``wanted``, they are
        asked (in the background) for that many, and the engine loop is woken when they answer."""
        held = sum(self._holds.get(request_id, {}).values())
        if (self.share_kv and held < wanted and request_id not in self._asking
                and time.monotonic() >= self._ask_again_at.get(request_id, 0.0)):
            self._asking.add(request_id)
            task = asyncio.get_running_loop().create_task(self._ask_holds(request_id, wanted))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return held

    def forget(self, request_id: str) -> None:
        """The request is gone: the peers keep nothing more for it."""
        holds = self._holds.pop(request_id, {})
        self._ask_again_at.pop(request_id, None)
        self._holds_set_at.pop(request_id, None)
        if request_id in self._asking:
            self._ended_while_asking.add(request_id)
        # Every peer asked, whatever this home counts as left there: a move the gManager ordered
        # may have used less of a hold than this home knows of.
        for inst_id in holds:
            task = asyncio.get_running_loop().create_task(self._set_hold(inst_id, request_id, 0))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _ask_holds(self, request_id: str, wanted: int) -> None:
        """All or nothing: holds summing to ``wanted`` from the peers with the most free blocks,
        one after the other; a peer that refuses says how much it has, and is asked once more
        for that. Short of ``wanted``, what was granted is given back and the request asks again
        after a random pause (two homes that split the memory do not both wait on it)."""
        try:
            if request_id in self._ended_while_asking:  # ended before this began
                return
            holds = self._holds.setdefault(request_id, {})
            short = wanted - sum(holds.values())
            for peer in self.peers.creditors(lambda p: p.num_blocks_free + holds.get(p.inst_id, 0)):
                for _attempt in range(2):
                    take = min(short, peer.num_blocks_free)  # after a refusal: the peer's own figure
                    if take <= 0:
                        break
                    current = holds.get(peer.inst_id, 0)
                    granted = await self._set_hold(peer.inst_id, request_id, current + take)
                    holds[peer.inst_id] = granted
                    self._holds_set_at.setdefault(request_id, {})[peer.inst_id] = time.monotonic()
                    if request_id in self._ended_while_asking:
                        break
                    if granted > current:
                        short -= granted - current
                        break
                if request_id in self._ended_while_asking:
                    # The request ended while its holds were asked for: ``forget`` took this
                    # table away without the grants that came after, which go back here.
                    await self._give_back_holds(request_id, holds)
                    return
                if short <= 0:
                    return
            log.info("request %s: peers keep %d of the %d blocks it needs to start; asking again",
                     request_id, sum(holds.values()), wanted)
            await self._give_back_holds(request_id, holds)
            self._ask_again_at[request_id] = time.monotonic() + HOLD_RETRY_S * (0.5 + random.random())
        finally:
            self._asking.discard(request_id)
            self._ended_while_asking.discard(request_id)
            self.wake()

    def renew_holds(self, now: float) -> None:
        """Renew (in the background) each hold a request still counts on, once ``hold_renew_s``
        has passed since it was set or renewed: a request may wait, or run without spilling, for
        longer than a peer keeps a hold, and would then count on blocks the peer has given to
        others. A renewal only keeps what the peer keeps (``HoldKV.renew``): it makes no hold,
        so one that crosses the request's end, or a spill that uses the hold up, leaves none
        behind; where the peer keeps fewer than this home counts (it let the hold go, or it
        drains), the home counts what it says."""
        for request_id, holds in self._holds.items():
            set_at = self._holds_set_at.setdefault(request_id, {})
            for inst_id, num_blocks in holds.items():
                if num_blocks <= 0 or (request_id, inst_id) in self._renewing:
                    continue
                if now - set_at.setdefault(inst_id, now) < self.hold_renew_s:
                    continue
                set_at[inst_id] = now
                self._renewing.add((request_id, inst_id))
                task = asyncio.get_running_loop().create_task(self._renew_hold(request_id, inst_id, now))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _renew_hold(self, request_id: str, inst_id: int, renewed_at: float) -> None:
        try:
            peer = self.peers.by_inst(inst_id)
            reply = await self.transport.request(
                peer.address, HoldKV(self.peers.own_inst_id, int(request_id), 0, home_run=self.run_id, renew=True),
                timeout_s=self.timeout_s)
        except (KeyError, TransportError) as exc:  # tried again at the next renewal, before it runs out
            log.warning("renewal of the hold for request %s on instance %d: %s", request_id, inst_id, exc)
            return
        finally:
            self._renewing.discard((request_id, inst_id))
        if not isinstance(reply, KVHoldReply):
            log.error("instance %d answered a hold's renewal with %r", inst_id, reply)
            return
        peer.num_blocks_free = reply.num_blocks_free
        holds = self._holds.get(request_id)
        # An ask set the hold meanwhile (its own time says so): its figure is the newer one.
        if (holds is None or inst_id not in holds
                or self._holds_set_at.get(request_id, {}).get(inst_id) != renewed_at):
            return
        if reply.num_blocks_held < holds[inst_id]:
            log.info("request %s: instance %d keeps %d of the %d blocks this home counted on", request_id,
                     inst_id, reply.num_blocks_held, holds[inst_id])
            holds[inst_id] = reply.num_blocks_held
            self.wake()

    async def _give_back_holds(self, request_id: str, holds: dict[int, int]) -> None:
        """Give every hold of the request back, once, and forget it: a peer that cannot be
        reached now is not asked again at every retry (its holds end with their time there)."""
        for inst_id in list(holds):
            await self._set_hold(inst_id, request_id, 0)
            holds.pop(inst_id, None)
            self._holds_set_at.get(request_id, {}).pop(inst_id, None)

    async def _set_hold(self, inst_id: int, request_id: str, num_blocks: int) -> int:
        """Ask peer ``inst_id`` to keep ``num_blocks`` for the request; the blocks it keeps."""
        peer = None
        try:
            peer = self.peers.by_inst(inst_id)
            reply = await self.transport.request(peer.address, HoldKV(self.peers.own_inst_id, int(request_id), num_blocks,
                                                                       home_run=self.run_id),
                                                 timeout_s=self.timeout_s)
        except (KeyError, TransportError) as exc:
            log.warning("hold of %d blocks for request %s on instance %d: %s", num_blocks, request_id, inst_id, exc)
            if peer is not None and num_blocks > 0:
                # Unreachable: no room is counted there until it publishes its free blocks again.
                peer.num_blocks_free = 0
            return 0
        if not isinstance(reply, KVHoldReply):
            raise RuntimeError(f"instance {inst_id} answered a hold with {reply!r}")
        peer.num_blocks_free = reply.num_blocks_free
        return reply.num_blocks_held

    def held_on(self, request_id: str, inst_id: int) -> int:
        """Blocks peer ``inst_id`` keeps for the request, as far as this home knows."""
        return self._holds.get(request_id, {}).get(inst_id, 0)

    def _used_hold(self, request_id: str, inst_id: int, num_blocks: int) -> int:
        """A piece of the request's spill reserved ``num_blocks`` on the peer: its hold shrinks.
        Returns how many of them the hold covered."""
        holds = self._holds.get(request_id)
        if not holds or inst_id not in holds:
            return 0
        covered = min(holds[inst_id], num_blocks)
        holds[inst_id] -= covered
        return covered

    def num_blocks_elsewhere(self) -> int:
        return self.peers.num_lendable_capacity() if self.share_kv else 0

    async def spill(self, engine: LLMEngine, num_blocks: int) -> None:
        if not self.share_kv:
            return  # the scheduler preempts instead, as a static instance does
        bm = engine.block_manager
        written = engine.num_written_tokens()
        # A request with a move between its reservation and its switch lends nothing now:
        # trying it would count a failed move that was never attempted.
        lendable = sorted(((self._lendable(bm, r, n), r) for r, n in written.items()), key=lambda x: (-x[0], x[1]))
        for count, request_id in lendable:
            if num_blocks <= 0:
                break
            # Peers that keep blocks for the request first (its home asked them before it
            # started), then the most free; on to the next while the request has blocks to lend
            # and more room is needed (one peer's room alone may not make enough).
            for peer in self.peers.creditors(lambda p: (self.held_on(request_id, p.inst_id), p.num_blocks_free)):
                if num_blocks <= 0 or count <= 0:
                    break
                take = min(count, num_blocks, peer.num_blocks_free + self.held_on(request_id, peer.inst_id))
                moved = await self.move(engine, request_id, take, peer) if take > 0 else 0
                num_blocks -= moved
                count -= moved

    def release(self, request_id: str, segment: Segment) -> None:
        peer = self.peers.by_engine(segment.instance_id)
        self._free_later(peer, FreeSegment(self.peers.own_inst_id, int(request_id),
                                           segment.token_start // self._block_size(), segment.copy_id))

    # ---- moves ---------------------------------------------------------------------------
    def _block_size(self) -> int:
        assert self.engine is not None
        return self.engine.config.block_size

    async def move(self, engine: LLMEngine, request_id: str, num_blocks: int, peer: Peer,
                   switch: Callable[[SegmentMove, Peer], Awaitable[bool]] | None = None, epoch: int = 0,
                   still_ordered: Callable[[], bool] | None = None) -> int:
        """Move the request's oldest ``num_blocks`` home blocks to ``peer``, in pieces of at
        most :func:`move_piece_blocks`, each reserved, sent, committed and switched before the
        next; it stops, as a partial move, once none of the rest is written. ``switch``: how a
        piece switches (None: at once, for a caller that holds the engine between steps; a
        background move passes one that waits for the next step boundary). ``epoch``: the
        gManager's, for a move it ordered (the peer refuses it once a newer leader spoke); 0 for
        this instance's own spills. ``still_ordered``: asked before each piece; False (a newer
        leader spoke since the order) stops the move there. Returns the blocks moved."""
        moved = 0
        while moved < num_blocks:
            if still_ordered is not None and not still_ordered():
                log.info("move of request %s stopped after %d blocks: its order is no longer the leader's",
                         request_id, moved)
                break
            room = peer.num_blocks_free + self.held_on(request_id, peer.inst_id)
            if moved and not (self.lendable_now(engine, request_id) and room > 0):
                break
            move = await self.send_move(engine, request_id, num_blocks - moved, peer, epoch)
            if move is None:
                break
            if not (self.switch_move(engine, move, peer) if switch is None else await switch(move, peer)):
                break
            moved += len(move.dst_block_ids)
        return moved

    async def until_not_moving(self, request_id: str, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no move of the request is between its reservation
        and its switch; whether none is."""
        deadline = time.monotonic() + timeout_s
        while request_id in self._moving:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)  # a piece takes round trips and a step boundary: ms
        return True

    def lendable_now(self, engine: LLMEngine, request_id: str) -> int:
        """Home blocks of the request a move could take now: full and written, and none while
        another move of it is between its reservation and its switch."""
        return self._lendable(engine.block_manager, request_id, engine.num_written_tokens().get(request_id, 0))

    def _lendable(self, bm: BlockManager, request_id: str, num_written: int) -> int:
        """``lendable_now``, with the request's written tokens given (a spill reads them all once)."""
        return 0 if request_id in self._moving else bm.num_lendable_blocks(request_id, num_written)

    async def send_move(self, engine: LLMEngine, request_id: str, num_blocks: int,
                        peer: Peer, epoch: int = 0) -> SegmentMove | None:
        """The first three phases of a move of the request's oldest ``num_blocks`` home blocks:
        reserve on ``peer``, send the data, have the peer commit. Returns the pending move, or
        None when it did not happen (nothing is left behind).

        The engine may step meanwhile: the moved blocks are full, so no step writes them, and
        the home attends over its own copy until :meth:`switch_move`, which must come at a step
        boundary.
        """
        pool = engine.pools[engine.home_instance_id]
        block_nbytes = pool[0].numel() * pool.element_size()
        num_blocks = min(num_blocks, self.lendable_now(engine, request_id), move_piece_blocks(block_nbytes))
        if num_blocks <= 0:
            log.info("move of request %s to instance %d: no block may move now (unwritten, or a move of it "
                     "in flight)", request_id, peer.inst_id)
            self.metrics.moves.labels(result="failed").inc()
            return None
        self._moving.add(request_id)
        move = None
        try:
            move = await self._send_move_piece(engine, request_id, num_blocks, peer, pool, block_nbytes, epoch)
        finally:
            if move is None:  # nothing pending: a later move of the request may start
                self._moving.discard(request_id)
        return move

    async def _send_move_piece(self, engine: LLMEngine, request_id: str, num_blocks: int, peer: Peer,
                               pool: torch.Tensor, block_nbytes: int, epoch: int) -> SegmentMove | None:
        bm = engine.block_manager
        own = self.peers.own_inst_id
        for attempt in range(2):
            move_id = next(self._move_ids)
            try:
                reply = await self.transport.request(peer.address, TryMoveKV(
                    epoch=epoch, move_id=move_id, req_id=int(request_id), home_inst_id=own, src_inst_id=own,
                    num_blocks=num_blocks, block_nbytes=block_nbytes, home_run=self.run_id), timeout_s=self.timeout_s)
            except TransportError as exc:
                log.warning("move of request %s to instance %d: %s", request_id, peer.inst_id, exc)
                self.metrics.moves.labels(result="failed").inc()
                return None
            # A refusal for want of room says how much there is (the figure we had was older):
            # ask once more for that much rather than nothing.
            if (attempt == 0 and isinstance(reply, MoveRejected) and reply.reason == MoveRejectReason.NO_SPACE
                    and 0 < reply.num_blocks_free < num_blocks):
                num_blocks = peer.num_blocks_free = reply.num_blocks_free
                continue
            break
        if isinstance(reply, MoveRejected):
            peer.num_blocks_free = reply.num_blocks_free
            log.info("move of %d blocks of request %s: instance %d refused (%s, %d blocks free there)",
                     num_blocks, request_id, peer.inst_id, reply.reason, reply.num_blocks_free)
            self.metrics.moves.labels(result="rejected").inc()
            return None
        if not isinstance(reply, MoveReserved) or len(reply.dst_block_ids) != num_blocks:
            # A peer's bug, not this request's: the move fails, the request goes on (a
            # reservation made there expires).
            log.warning("move of request %s: instance %d answered a try-move of %d blocks with %r",
                        request_id, peer.inst_id, num_blocks, reply)
            self.metrics.moves.labels(result="failed").inc()
            return None
        # Taken there, until the peer's next figure says otherwise: the blocks beyond what it kept
        # for the request (its figure left its holds out already). Counted once, here, whatever
        # becomes of the move: an abandoned reservation comes back with the peer's next figure.
        from_hold = self._used_hold(request_id, peer.inst_id, num_blocks)
        peer.num_blocks_free = max(0, peer.num_blocks_free - (num_blocks - from_hold))
        written = engine.num_written_tokens().get(request_id, 0)
        try:
            move = bm.lend_to_remote(request_id, peer.engine_id, reply.dst_block_ids, written,
                                     copy_id=reply.reservation_id)
        except (OutOfBlocks, ValueError, KeyError) as exc:
            # The request finished or shrank while the reservation was made: it expires there.
            log.info("move of request %s abandoned: %s", request_id, exc)
            self.metrics.moves.labels(result="failed").inc()
            return None
        segment_id = move.token_start // engine.config.block_size
        try:
            # One buffer per run of consecutive destination blocks (the reservation is contiguous
            # where the peer's pool allows): a view of the home pool, or a gather of its blocks.
            # Committed there with its data: nothing is checked here between the two.
            stored = await self._packer.send(
                self.transport, peer.address, pool, move.src_block_ids, move.dst_block_ids,
                lambda runs, data: KVBlocks(move_id, reply.reservation_id, runs, data, commit_segment_id=segment_id,
                                            home_inst_id=self.peers.own_inst_id, req_id=int(request_id)),
                kv_data_timeout_s(self.timeout_s, num_blocks * block_nbytes))
            if not isinstance(stored, KVBlocksStored) or stored.num_blocks != num_blocks:
                raise RuntimeError(f"instance {peer.inst_id} stored {stored!r}")
            failpoints.reached("home.sent")
        except (TransportError, RuntimeError, TimeoutError) as exc:
            self._abandon(engine, move, peer)
            log.warning("move of request %s to instance %d failed: %s", request_id, peer.inst_id, exc)
            self.metrics.moves.labels(result="failed").inc()
            return None
        return move

    def prepare(self, pool: torch.Tensor) -> None:
        """Make the packer's stream for a device pool now (``KVPacker.prepare``)."""
        self._packer.prepare(pool)

    @property
    def packer(self) -> KVPacker:
        """How this instance packs the KV blocks it sends (its creditor forwards too)."""
        return self._packer

    def switch_move(self, engine: LLMEngine, move: SegmentMove, peer: Peer) -> bool:
        """The last phase, at a step boundary: the home's table points at the peer's copy and
        the home blocks are freed. False when the request ended meanwhile (the peer's copy is
        freed then)."""
        self._moving.discard(move.request_id)
        try:
            engine.block_manager.commit_move(move)
        except (KeyError, ValueError):  # the request finished or was cancelled after the commit
            self._abandon(engine, move, peer)
            self.metrics.moves.labels(result="failed").inc()
            return False
        self.metrics.moves.labels(result="committed").inc()
        return True

    def _abandon(self, engine: LLMEngine, move: SegmentMove, peer: Peer) -> None:
        """Undo a pending move: the table keeps the home blocks; the peer frees its copy (the
        commit may have landed before its reply was lost)."""
        self._moving.discard(move.request_id)
        try:
            engine.block_manager.abort_move(move)
        except ValueError:
            pass  # no longer pending: the request's end aborted it
        self.release(move.request_id, Segment(peer.engine_id, move.dst_block_ids, move.token_start, move.num_tokens,
                                              move.dst_copy_id))

    async def move_held(self, engine: LLMEngine, request_id: str, num_blocks: int, src: Peer, dst: Peer,
                        epoch: int, still_ordered: Callable[[], bool] | None = None,
                        at_step_boundary: Callable[[Callable[[], object]], Awaitable[object]] | None = None) -> bool:
        """Move the request's segments held by ``src`` to ``dst``, whole, oldest first, as many
        as fit in ``num_blocks``; True once all of them moved. A failure stops there: the
        segments moved before it stay moved, the rest stay on ``src``. ``still_ordered``: asked
        before each segment; False (a newer leader spoke since the order) stops there too.

        The table switches only once ``dst`` committed each copy, at a step boundary
        (``at_step_boundary`` runs a function there and returns its result; None: the caller
        is between steps itself), and ``src`` frees its copy only after the switch: a step
        under way reads the copy it started with. One such move of a request at a time.
        """
        if src.inst_id == dst.inst_id:
            raise ValueError(f"a move from instance {src.inst_id} to itself")
        if request_id in self._relocating_requests:
            raise ValueError(f"request {request_id} has a move of its held segments under way")
        bm = engine.block_manager
        picked, total = [], 0
        for segment in bm.block_table(request_id):
            if segment.instance_id != src.engine_id:
                continue
            if total + len(segment.block_ids) > num_blocks:
                break
            picked.append(segment)
            total += len(segment.block_ids)
        if not picked:
            raise ValueError(f"request {request_id} has no whole segment of at most {num_blocks} blocks "
                             f"on instance {src.inst_id}")
        self._relocating_requests.add(request_id)
        try:
            for segment in picked:
                if still_ordered is not None and not still_ordered():
                    log.info("move of request %s's segments to instance %d stopped: its order is no longer the "
                             "leader's", request_id, dst.inst_id)
                    return False
                if not await self._relocate(engine, request_id, segment, src, dst, epoch, at_step_boundary):
                    return False
            return True
        finally:
            self._relocating_requests.discard(request_id)

    async def _relocate(self, engine: LLMEngine, request_id: str, segment: Segment, src: Peer, dst: Peer,
                        epoch: int, at_step_boundary) -> bool:
        """One segment from creditor ``src`` to creditor ``dst``: reserve, forward, commit, switch, free.
        While it runs, an audit from ``dst`` counts the segment as this home's there."""
        relocating = (request_id, segment.token_start, dst.engine_id)
        self._relocating.add(relocating)
        try:
            return await self._relocate_audited(engine, request_id, segment, src, dst, epoch, at_step_boundary)
        finally:
            self._relocating.discard(relocating)

    async def _relocate_audited(self, engine: LLMEngine, request_id: str, segment: Segment, src: Peer, dst: Peer,
                                epoch: int, at_step_boundary) -> bool:
        bm = engine.block_manager
        pool = engine.pools[engine.home_instance_id]
        block_nbytes = pool[0].numel() * pool.element_size()  # the cluster shares one layout
        move_id = next(self._move_ids)
        own = self.peers.own_inst_id
        segment_id = segment.token_start // engine.config.block_size
        num_blocks = len(segment.block_ids)
        try:
            reply = await self.transport.request(dst.address, TryMoveKV(
                epoch=epoch, move_id=move_id, req_id=int(request_id), home_inst_id=own, src_inst_id=src.inst_id,
                num_blocks=num_blocks, block_nbytes=block_nbytes, home_run=self.run_id), timeout_s=self.timeout_s)
        except TransportError as exc:
            log.warning("move of request %s's segment %d to instance %d: %s", request_id, segment_id, dst.inst_id, exc)
            self.metrics.moves.labels(result="failed").inc()
            return False
        if isinstance(reply, MoveRejected):
            dst.num_blocks_free = reply.num_blocks_free
            log.info("instance %d refused request %s's segment %d: %s", dst.inst_id, request_id, segment_id,
                     reply.reason.value)
            self.metrics.moves.labels(result="rejected").inc()
            return False
        if not isinstance(reply, MoveReserved) or len(reply.dst_block_ids) != num_blocks:
            log.warning("instance %d answered a try-move of request %s's segment %d (%d blocks) with %r",
                        dst.inst_id, request_id, segment_id, num_blocks, reply)
            self.metrics.moves.labels(result="failed").inc()
            return False
        committed = False
        try:
            # The source sends the blocks within its own allowance for their size
            # (``kv_data_timeout_s``); this waits one more request's time for its answer.
            stored = await self.transport.request(src.address, ForwardSegment(
                epoch=epoch, move_id=move_id, home_inst_id=own, req_id=int(request_id), segment_id=segment_id,
                dst_inst_id=dst.inst_id, dst_host=dst.address.host, dst_port=dst.address.port,
                reservation_id=reply.reservation_id, dst_block_ids=reply.dst_block_ids),
                timeout_s=kv_data_timeout_s(self.timeout_s, num_blocks * block_nbytes) + self.timeout_s)
            if not isinstance(stored, KVBlocksStored) or stored.num_blocks != num_blocks:
                raise RuntimeError(f"instance {src.inst_id} forwarded {stored!r}")
            if segment not in bm.block_table(request_id):
                # The request ended (or its table changed) while the data travelled: no commit,
                # the reservation expires there.
                raise RuntimeError(f"request {request_id} no longer has segment {segment_id} on {src.inst_id}")
            committed = True  # from here a failure may leave a committed copy there
            try:
                await self.transport.request(dst.address, MoveCommit(
                    move_id, reply.reservation_id, int(request_id), own, segment_id), timeout_s=self.timeout_s)
            except RemoteError:
                committed = False  # refused: nothing was committed there (the reservation expires)
                raise
            def switch() -> None:  # the steps after it attend at dst
                bm.relocate_remote(request_id, segment.token_start, src.engine_id, dst.engine_id,
                                   reply.dst_block_ids, copy_id=reply.reservation_id, src_copy_id=segment.copy_id)
            if at_step_boundary is None:
                switch()
            else:
                await at_step_boundary(switch)
        except (TransportError, RuntimeError, ValueError, KeyError) as exc:
            log.warning("move of request %s's segment %d from instance %d to %d failed: %s", request_id, segment_id,
                        src.inst_id, dst.inst_id, exc)
            self.metrics.moves.labels(result="failed").inc()
            if committed:
                # The commit may have landed before its answer was lost: free the copy there.
                self._free_later(dst, FreeSegment(own, int(request_id), segment_id, reply.reservation_id))
            return False
        self._free_later(src, FreeSegment(own, int(request_id), segment_id, segment.copy_id))
        dst.num_blocks_free = max(0, dst.num_blocks_free - num_blocks)
        self.metrics.moves.labels(result="committed").inc()
        return True

    def stale_held(self, engine: LLMEngine, audit: AuditHeld) -> AuditHeldReply:
        """The home's answer to a creditor's audit: of the segments it names, those this home no
        longer counts on there (no table points at them, no move lands them there). Each is
        freed, or its FreeSegment is on its way: the creditor may free them. ValueError for a
        creditor that is not a peer yet (nothing can be said of it: the creditor frees nothing)."""
        try:
            creditor = self.peers.by_inst(audit.creditor_inst_id)
        except KeyError:
            raise ValueError(f"instance {audit.creditor_inst_id} is not a peer of instance "
                             f"{self.peers.own_inst_id} yet") from None
        bm = engine.block_manager
        block_size = engine.config.block_size
        stale = []
        for ref in audit.segments:
            request_id, token_start = str(ref.req_id), ref.segment_id * block_size
            # A relocation to the creditor counts whatever its copy (its id comes with the
            # reservation, which may be answered after this).
            if not (bm.counts_on(request_id, token_start, creditor.engine_id, ref.reservation_id)
                    or (request_id, token_start, creditor.engine_id) in self._relocating):
                stale.append(ref)
        return AuditHeldReply(tuple(stale))

    def next_move_id(self) -> int:
        """A move id of this home's own (a spill's, an APB prefill's reservations)."""
        return next(self._move_ids)

    def count_on(self, request_id: str, token_start: int, peer: Peer) -> None:
        """Until :meth:`stop_counting_on`, audits from ``peer`` find its segment of the request at
        ``token_start`` counted on, whatever its copy: it is being made there (an APB prefill's
        chunk, committed before the table names it)."""
        self._relocating.add((request_id, token_start, peer.engine_id))

    def stop_counting_on(self, request_id: str, token_start: int, peer: Peer) -> None:
        self._relocating.discard((request_id, token_start, peer.engine_id))

    def free_copy(self, peer: Peer, request_id: str, segment_id: int, reservation_id: int) -> None:
        """Have ``peer`` free its copy ``reservation_id`` of a segment no table names (sent in
        the background, again while it cannot be sent)."""
        self._free_later(peer, FreeSegment(self.peers.own_inst_id, int(request_id), segment_id, reservation_id))

    def _free_later(self, peer: Peer, message: FreeSegment) -> None:
        task = asyncio.get_running_loop().create_task(self._send_free(peer, message))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_free(self, peer: Peer, message: FreeSegment) -> None:
        """Send a FreeSegment, again after pauses while it cannot be sent: a peer hears from
        this home at every tick, so it would never free the segment of itself."""
        for pause in (0.0, *FREE_RETRY_PAUSES_S):
            if pause:
                await asyncio.sleep(pause)
            try:
                await self.transport.send(peer.address, message, timeout_s=self.timeout_s)
                return
            except TransportError as exc:
                log.warning("freeing request %d's segment %d on instance %d: %s%s", message.req_id,
                            message.segment_id, peer.inst_id, exc, "" if pause == FREE_RETRY_PAUSES_S[-1] else "; again later")

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=self.timeout_s)


async def audit_held(transport: Transport, ledger: CreditorLedger, own_inst_id: int, home_inst_id: int,
                     home: PeerAddress, timeout_s: float,
                     after: tuple[int, int] | None = None) -> tuple[int, tuple[int, int] | None]:
    """The creditor's audit of what it holds for one home: name the segments to the home, free
    those it answers it no longer counts on. At most ``MAX_AUDITED_SEGMENTS`` at a time, in
    (request, segment) order from the first after ``after`` (None: from the first). Returns the
    blocks freed and where the next audit goes on: the last (request, segment) named, or None
    once the last segment had its turn.

    A FreeSegment lost for good (the home's retries all failed) would otherwise keep its blocks
    for as long as the home lives: the home publishes all along, so it never looks lost."""
    held = sorted(ledger.held_for(home_inst_id), key=lambda s: (s.req_id, s.segment_id))
    if after is not None:
        held = [s for s in held if (s.req_id, s.segment_id) > after]
    audited = held[:MAX_AUDITED_SEGMENTS]
    if not audited:
        return 0, None
    next_after = (audited[-1].req_id, audited[-1].segment_id) if len(held) > len(audited) else None
    by_ref = {HeldSegmentRef(s.req_id, s.segment_id, s.reservation_id): s for s in audited}
    reply = await transport.request(home, AuditHeld(own_inst_id, tuple(by_ref)), timeout_s=timeout_s)
    if not isinstance(reply, AuditHeldReply):
        raise RuntimeError(f"instance {home_inst_id} answered an audit with {type(reply).__name__}")
    return ledger.free_audited(by_ref[ref] for ref in reply.stale if ref in by_ref), next_after


def kv_data_timeout_s(request_timeout_s: float, nbytes: int) -> float:
    """How long a request carrying ``nbytes`` of KV blocks may take to be answered, s."""
    return request_timeout_s + nbytes / MOVE_BYTES_PER_S_FLOOR


async def forward_segment(transport: Transport, ledger: CreditorLedger, pool: torch.Tensor, message: ForwardSegment,
                          timeout_s: float, *, packer: KVPacker) -> KVBlocksStored:
    """The creditor's share of a creditor-to-creditor move: send a held segment's blocks from
    ``pool`` (``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``) straight into
    the destination's reservation and return the destination's acknowledgement.

    The segment stays held here (its home may still attend over it) until the home frees it.
    Lent blocks are full and never written again, so reading them while serving attention is safe.
    ``packer``: gathers the blocks as the home's mover does (the instance's, shared with it).
    Within the same allowance as the home's wait for this answer (``kv_data_timeout_s`` of the
    segment's bytes); a send that fails or times out raises ValueError, which the home hears as
    the reason this answered no acknowledgement.
    """
    segment = ledger.segment(message.home_inst_id, message.req_id, message.segment_id)
    if len(message.dst_block_ids) != len(segment.block_ids):
        raise ValueError(f"segment {message.segment_id} of request {message.req_id} has {len(segment.block_ids)} "
                         f"blocks here, {len(message.dst_block_ids)} were reserved")
    nbytes = pool[0].nbytes * len(segment.block_ids)
    failpoints.reached("forward.begin")
    try:
        stored = await packer.send(
            transport, PeerAddress(message.dst_host, message.dst_port), pool, segment.block_ids, message.dst_block_ids,
            lambda runs, data: KVBlocks(message.move_id, message.reservation_id, runs, data,
                                        home_inst_id=message.home_inst_id, req_id=message.req_id),
            kv_data_timeout_s(timeout_s, nbytes))
    except (TransportError, TimeoutError) as exc:
        # Not this creditor's fault: the home hears why, and this logs a warning, no traceback.
        raise ValueError(f"segment {message.segment_id} of request {message.req_id} not sent to instance "
                         f"{message.dst_inst_id}: {exc}") from None
    if not isinstance(stored, KVBlocksStored):
        raise RuntimeError(f"instance {message.dst_inst_id} answered the blocks with {type(stored).__name__}")
    ledger.heard_from(message.home_inst_id, time.monotonic())
    failpoints.reached("forward.sent")
    return stored
