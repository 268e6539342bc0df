"""Every message that instances and the gManager exchange, one frozen dataclass each.

A message is plain data: ints, bools, strings, tuples of small records, and tensors. Tensors
travel as raw buffers beside the orjson header (see ``codec``); a tensor field holds any
C-contiguous array (numpy, torch CPU or CUDA, cupy) on the sending side and, on the receiving
side, whatever the receiver placed the bytes into (a torch tensor by default, a view of the KV
pool for ``KVBlocks``).

Versions: ``PROTOCOL_VERSION`` covers the frame layout; each message type has its own
``VERSION``, bumped when its fields change. Both are checked on receipt.

Messages that repeat (heartbeats) carry diffs against a numbered base rather than full state:
``Heartbeat.placement_base_version`` names the version the diff applies to (0: the diff is the
full state), and the gManager asks for full state with ``HeartbeatReply.needs_full_placement``
when it does not hold that base (a new leader, a lost heartbeat). ``placement`` applies diffs.

Units are given in a comment on every field. Row counts are rows of the query tensor; block
counts are KV blocks (``block_size`` tokens of K and V over all layers).

Commands from the gManager carry the leader's ``epoch`` (the create revision of the leader key
in etcd); instances refuse epochs older than the newest they have seen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, Protocol, runtime_checkable

# 2: each frame's buffers on a UCX tag of the frame's own; 3: each header ends in its end mark
# (``codec.TRAILER``)
PROTOCOL_VERSION = 3
# Segments named in one AuditHeld: a creditor with more held for one home audits them in turns.
MAX_AUDITED_SEGMENTS = 4096


@runtime_checkable
class WireArray(Protocol):
    """What a tensor field holds: numpy, torch and cupy arrays all have these."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> object: ...


class ErrorCode(StrEnum):
    """Why a frame or a request was refused; sent in ``ErrorReply.code``."""

    TRUNCATED_FRAME = "truncated_frame"
    OVERSIZED_FRAME = "oversized_frame"
    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_JSON = "invalid_json"
    INVALID_FIELDS = "invalid_fields"
    LENGTH_MISMATCH = "length_mismatch"
    BUFFER_TOO_LARGE = "buffer_too_large"
    TOO_MANY_BUFFERS = "too_many_buffers"
    PLACEMENT_REFUSED = "placement_refused"
    HANDLER_FAILED = "handler_failed"
    NO_HANDLER = "no_handler"
    STALE_EPOCH = "stale_epoch"
    SHARED_MEMORY_UNAVAILABLE = "shared_memory_unavailable"
    # A request's buffers in the sender's shared memory were past their time (its ``su``) when
    # the receiver came to copy them: the sender may use those slots again.
    EXPIRED = "expired"
    DEVICE_POOL_UNAVAILABLE = "device_pool_unavailable"
    STEP_MAILBOX_UNAVAILABLE = "step_mailbox_unavailable"  # no mailbox can be made or shared here
    STEP_REFUSED = "step_refused"  # a StepBegin naming a mailbox or segments not here


class MoveRejectReason(StrEnum):
    NO_SPACE = "no_space"  # fewer free blocks than asked for
    LAYOUT_MISMATCH = "layout_mismatch"  # block_nbytes differs from the destination's pool
    DRAINING = "draining"  # the destination is being drained
    STALE_EPOCH = "stale_epoch"  # the move belongs to a deposed leader


# --- records nested inside messages (encoded as JSON arrays in field order) ----------------


@dataclass(frozen=True)
class PoolFigures:
    num_blocks_total: int  # blocks in this instance's KV pool
    num_blocks_free: int  # blocks neither used nor reserved
    num_blocks_lent: int  # blocks here that hold other instances' requests
    num_blocks_borrowed: int  # blocks of this instance's requests held on other instances

    def __post_init__(self) -> None:
        _require_not_negative("pool figures", self.num_blocks_total, self.num_blocks_free,
                              self.num_blocks_lent, self.num_blocks_borrowed)


@dataclass(frozen=True)
class RequestPlacementEntry:
    req_id: int  # request id, unique per home instance
    inst_id: int  # instance whose pool holds these blocks
    num_blocks: int  # blocks of the request held there
    local: bool  # True when inst_id is the request's home
    # False while none of these blocks may move (the prompt is still being written, or a move
    # of the request is under way): the gManager plans no move of them until it is True.
    movable: bool = True

    def __post_init__(self) -> None:
        # num_blocks: the gManager's policy refuses a negative count itself (scheduler/policy.py).
        _require_not_negative("req_id and inst_id", self.req_id, self.inst_id)


@dataclass(frozen=True)
class PlacementKey:
    """Names an entry to remove: one request's blocks on one instance."""

    req_id: int  # request id
    inst_id: int  # instance that held the blocks

    def __post_init__(self) -> None:
        _require_not_negative("req_id and inst_id", self.req_id, self.inst_id)


@dataclass(frozen=True)
class CreditorHint:
    inst_id: int  # an instance with spare blocks
    num_blocks_free: int  # its free blocks at its last heartbeat

    def __post_init__(self) -> None:
        _require_not_negative("inst_id and num_blocks_free", self.inst_id, self.num_blocks_free)


@dataclass(frozen=True)
class AttendSlice:
    """The query rows of one request inside an ``AttendRequest`` and what they attend over."""

    req_id: int  # request id
    row_start: int  # first row of this request in the message's q, rows
    num_rows: int  # rows of this request, 1 for decode, more for chunked prefill
    segment_id: int  # the first segment (run of this request's blocks) held by the creditor
    # Tokens to attend over from that segment's start, on across the consecutive segments held there.
    num_tokens: int


@dataclass(frozen=True)
class HeldSegmentRef:
    """Names one segment a creditor holds for a home."""

    req_id: int  # request id, unique per home instance
    segment_id: int  # the home's id for the segment (its first block's index in the request)
    reservation_id: int  # the creditor's reservation the copy was committed from

    def __post_init__(self) -> None:
        _require_not_negative("req_id, segment_id and reservation_id", self.req_id, self.segment_id,
                              self.reservation_id)


@dataclass(frozen=True)
class BlockRun:
    """A run of consecutive destination block ids filled by one buffer of ``KVBlocks``."""

    dst_block_id: int  # first block id in the destination's pool
    num_blocks: int  # blocks in the run


# --- messages ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heartbeat:
    """Instance -> gManager, every heartbeat period. The placement part is a diff."""

    TYPE: ClassVar[str] = "heartbeat"
    VERSION: ClassVar[int] = 3  # 2: RequestPlacementEntry.movable; 3: the remote-attention figures

    inst_id: int  # sender
    seq: int  # heartbeat number, increasing per instance life
    pool: PoolFigures  # blocks
    batch_size: int  # running requests, requests
    placement_base_version: int  # version the diff applies to; 0 means full state follows
    placement_version: int  # version after applying the diff
    placement_upserts: tuple[RequestPlacementEntry, ...]  # entries added or changed
    placement_removals: tuple[PlacementKey, ...]  # entries gone
    # Since the previous heartbeat: this home's waits for creditors' parts (one per creditor and
    # layer, from sending the query to resuming with the reply), and this creditor's time
    # serving other homes' attend requests.
    remote_wait_us: int = 0  # the waits summed, microseconds
    remote_waits: int = 0  # waits, count
    attend_serve_us: int = 0  # serving times summed, microseconds
    attend_serves: int = 0  # attend requests served, count

    def __post_init__(self) -> None:
        # batch_size: the gManager refuses a negative one itself (an answer, not a refused frame).
        _require_not_negative("inst_id and seq", self.inst_id, self.seq)
        _require(self.placement_version > self.placement_base_version >= 0,
                 "placement_version must exceed placement_base_version >= 0")
        if self.placement_base_version == 0:
            _require(not self.placement_removals, "a full placement has no removals")
        _require(min(self.remote_wait_us, self.remote_waits, self.attend_serve_us, self.attend_serves) >= 0,
                 "remote-attention figures must be >= 0")


@dataclass(frozen=True)
class HeartbeatReply:
    TYPE: ClassVar[str] = "heartbeat_reply"
    VERSION: ClassVar[int] = 1

    epoch: int  # leader's epoch
    acked_placement_version: int  # newest placement version the gManager holds for the sender
    needs_full_placement: bool  # the gManager lacks the base: send the full placement next
    creditors: tuple[CreditorHint, ...]  # where to spill blocks if the pool runs out

    def __post_init__(self) -> None:
        _require_not_negative("epoch and acked_placement_version", self.epoch, self.acked_placement_version)


@dataclass(frozen=True)
class AttendRequest:
    """Home -> creditor: one layer's query rows of every request of this home it holds."""

    TYPE: ClassVar[str] = "attend_request"
    VERSION: ClassVar[int] = 2  # 2: a slice may span consecutive held segments
    TENSORS: ClassVar[tuple[str, ...]] = ("q",)

    home_inst_id: int  # sender
    creditor_inst_id: int  # receiver
    step_id: int  # the home's engine step
    layer: int  # layer index
    slices: tuple[AttendSlice, ...]  # requests in row order, covering q's rows exactly
    q: WireArray  # [num_rows, num_heads, head_dim], the model's dtype

    def __post_init__(self) -> None:
        # One OR: negative where any is (a decode step builds one of these per creditor and layer).
        if (self.home_inst_id | self.creditor_inst_id | self.step_id | self.layer) < 0:
            raise ValueError("home_inst_id, creditor_inst_id, step_id and layer must be >= 0")
        _require(len(self.q.shape) == 3, "q must be [num_rows, num_heads, head_dim]")
        _require_rows_covered(self.slices, self.q.shape[0])


@dataclass(frozen=True)
class AttendResult:
    """Creditor -> home: the partial attention of every row of the request, in its row order."""

    TYPE: ClassVar[str] = "attend_result"
    VERSION: ClassVar[int] = 1
    TENSORS: ClassVar[tuple[str, ...]] = ("out", "lse")

    home_inst_id: int  # receiver
    creditor_inst_id: int  # sender
    step_id: int  # echoed from the request
    layer: int  # echoed from the request
    out: WireArray  # [num_rows, num_heads, head_dim], the model's dtype
    lse: WireArray  # [num_rows, num_heads] float32, natural log; -inf for rows with no keys

    def __post_init__(self) -> None:
        if (self.home_inst_id | self.creditor_inst_id | self.step_id | self.layer) < 0:
            raise ValueError("home_inst_id, creditor_inst_id, step_id and layer must be >= 0")
        _require(len(self.out.shape) == 3, "out must be [num_rows, num_heads, head_dim]")
        _require(tuple(self.lse.shape) == tuple(self.out.shape[:2]),
                 "lse must be [num_rows, num_heads] of out")
        _require(_dtype_name(self.lse.dtype) == "float32", "lse must be float32")


@dataclass(frozen=True)
class TryMoveKV:
    """Source -> destination: reserve ``num_blocks`` blocks for a move, or refuse."""

    TYPE: ClassVar[str] = "try_move_kv"
    VERSION: ClassVar[int] = 2  # 2: home_run

    epoch: int  # epoch of the MoveKV command being carried out; 0 for a spill of the source's own
    move_id: int  # chosen by whoever ordered the move, unique per epoch
    req_id: int  # request whose blocks move
    home_inst_id: int  # the request's home
    src_inst_id: int  # instance whose pool the data comes from: the sender, or for a segment
    #                   a creditor holds, that creditor (the home asks, the creditor sends)
    num_blocks: int  # blocks to reserve
    block_nbytes: int  # bytes of one block over all layers; the destination checks its layout
    # The home's run (the run_id of its membership record, new at each start); 0: not said. A
    # destination that holds blocks for another run of the home frees them first: that run is
    # gone, and this one knows nothing of them.
    home_run: int = 0

    def __post_init__(self) -> None:
        _require_not_negative("epoch, move_id, req_id, home_inst_id, src_inst_id and home_run", self.epoch,
                              self.move_id, self.req_id, self.home_inst_id, self.src_inst_id, self.home_run)
        _require(self.num_blocks > 0, "num_blocks must be positive")
        _require(self.block_nbytes > 0, "block_nbytes must be positive")


@dataclass(frozen=True)
class MoveReserved:
    TYPE: ClassVar[str] = "move_reserved"
    VERSION: ClassVar[int] = 1

    move_id: int  # echoed
    reservation_id: int  # chosen by the destination
    dst_block_ids: tuple[int, ...]  # reserved blocks, in the order the source's blocks fill them
    expires_in_ms: int  # ms until an uncommitted reservation is released

    def __post_init__(self) -> None:
        _require_not_negative("move_id, reservation_id and expires_in_ms", self.move_id,
                              self.reservation_id, self.expires_in_ms)
        _require_block_ids(self.dst_block_ids)


@dataclass(frozen=True)
class MoveRejected:
    TYPE: ClassVar[str] = "move_rejected"
    VERSION: ClassVar[int] = 1

    move_id: int  # echoed
    reason: MoveRejectReason
    num_blocks_free: int  # the destination's free blocks now, blocks

    def __post_init__(self) -> None:
        _require_not_negative("move_id and num_blocks_free", self.move_id, self.num_blocks_free)


@dataclass(frozen=True)
class HoldKV:
    """Home -> creditor: keep ``num_blocks`` of this pool for one request's spills, so that a
    request that needs peer memory starts only on memory no other home counts on. Sets the
    hold (0 releases it); the creditor takes it first come, first served, all or nothing. With
    ``renew``, the hold is kept as it is for another ``kv_hold_s`` (its size is the creditor's
    figure, which spills may have used up since; none is made where none is kept). A draining
    creditor keeps none."""

    TYPE: ClassVar[str] = "hold_kv"
    VERSION: ClassVar[int] = 3  # 2: home_run; 3: renew

    home_inst_id: int  # the request's home, the sender
    req_id: int
    num_blocks: int  # blocks to keep for the request from now on; 0: keep none (renew: not read)
    home_run: int = 0  # the home's run, as in TryMoveKV
    renew: bool = False  # keep what is kept for longer, whatever num_blocks says

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id, req_id, num_blocks and home_run", self.home_inst_id, self.req_id,
                              self.num_blocks, self.home_run)


@dataclass(frozen=True)
class KVHoldReply:
    TYPE: ClassVar[str] = "kv_hold_reply"
    VERSION: ClassVar[int] = 1

    num_blocks_held: int  # kept for the request now: as asked, or what was kept before
    num_blocks_free: int  # this pool's blocks free for others now, holds taken off, blocks

    def __post_init__(self) -> None:
        _require_not_negative("num_blocks_held and num_blocks_free", self.num_blocks_held, self.num_blocks_free)


@dataclass(frozen=True)
class KVBlocks:
    """Source -> destination: block data, one buffer per run, received into reserved blocks."""

    TYPE: ClassVar[str] = "kv_blocks"
    VERSION: ClassVar[int] = 3  # 2: commit_segment_id; 3: home_inst_id, req_id
    TENSORS: ClassVar[tuple[str, ...]] = ("runs_data",)

    move_id: int  # echoed
    reservation_id: int  # from MoveReserved
    runs: tuple[BlockRun, ...]  # destination runs, one per buffer
    runs_data: tuple[WireArray, ...]  # buffer i: [runs[i].num_blocks, num_layers, 2, block_size,
    #                                      num_kv_heads, head_dim], the pool's dtype
    # -1: a MoveCommit follows (a creditor forwarding a segment; the home commits once it has
    # checked its table). Otherwise the home's own move, which checks nothing between the data
    # and the commit: once the data is stored, the reservation becomes this segment of its
    # request, as MoveCommit would make it, and a round trip is saved.
    commit_segment_id: int = -1
    # The request the reservation was made for, which the destination checks against its own
    # record of it (-1: not named; an instance daemon refuses such blocks).
    home_inst_id: int = -1
    req_id: int = -1

    def __post_init__(self) -> None:
        _require(len(self.runs) == len(self.runs_data), "one buffer per run")
        _require_not_negative("move_id and reservation_id", self.move_id, self.reservation_id)
        _require(self.commit_segment_id >= -1, "commit_segment_id is a segment id or -1")
        _require(self.home_inst_id >= -1 and self.req_id >= -1, "home_inst_id and req_id are ids or -1")
        for run, data in zip(self.runs, self.runs_data):
            _require(run.num_blocks > 0 and run.dst_block_id >= 0,
                     "a run has at least one block, from a block id >= 0")
            _require(len(data.shape) >= 1 and data.shape[0] == run.num_blocks,
                     "a run's buffer has num_blocks blocks in its first dimension")


@dataclass(frozen=True)
class KVBlocksStored:
    """Destination -> source: the data of a ``KVBlocks`` is in the reserved blocks."""

    TYPE: ClassVar[str] = "kv_blocks_stored"
    VERSION: ClassVar[int] = 1

    move_id: int  # echoed
    reservation_id: int  # echoed
    num_blocks: int  # blocks written, blocks

    def __post_init__(self) -> None:
        _require_not_negative("move_id, reservation_id and num_blocks", self.move_id, self.reservation_id,
                              self.num_blocks)


@dataclass(frozen=True)
class MoveCommit:
    """The reserved blocks become a segment of the request; the reservation no longer expires."""

    TYPE: ClassVar[str] = "move_commit"
    VERSION: ClassVar[int] = 1

    move_id: int  # echoed
    reservation_id: int  # from MoveReserved
    req_id: int  # request
    home_inst_id: int  # the request's home, which switched its block table
    segment_id: int  # the id the home gives the new segment in its block table

    def __post_init__(self) -> None:
        _require_not_negative("move_id, reservation_id, req_id, home_inst_id and segment_id", self.move_id,
                              self.reservation_id, self.req_id, self.home_inst_id, self.segment_id)


@dataclass(frozen=True)
class FreeSegment:
    TYPE: ClassVar[str] = "free_segment"
    VERSION: ClassVar[int] = 2  # 2: reservation_id

    home_inst_id: int  # the request's home
    req_id: int  # request
    segment_id: int  # segment whose blocks the receiver frees
    # The receiver's reservation the copy was committed from (MoveReserved): a free that comes
    # late (sent again after a failure) leaves a newer copy under the same segment id alone.
    reservation_id: int

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id, req_id, segment_id and reservation_id", self.home_inst_id,
                              self.req_id, self.segment_id, self.reservation_id)


@dataclass(frozen=True)
class AuditHeld:
    """Creditor -> home, now and then: the segments of the home's requests held here. The home
    answers with those it no longer counts on, and the creditor frees them: what a FreeSegment
    lost for good (every retry failed) would otherwise keep held for as long as the home lives."""

    TYPE: ClassVar[str] = "audit_held"
    VERSION: ClassVar[int] = 1

    creditor_inst_id: int  # sender
    segments: tuple[HeldSegmentRef, ...]  # held here for the receiver's requests

    def __post_init__(self) -> None:
        _require(self.creditor_inst_id >= 0, "creditor_inst_id must be >= 0")
        _require(len(self.segments) <= MAX_AUDITED_SEGMENTS,
                 f"at most {MAX_AUDITED_SEGMENTS} segments in one audit")


@dataclass(frozen=True)
class AuditHeldReply:
    TYPE: ClassVar[str] = "audit_held_reply"
    VERSION: ClassVar[int] = 1

    # Of the audit's segments, those the home's tables do not point at on the creditor and no
    # move of the home is landing there: the creditor may free them.
    stale: tuple[HeldSegmentRef, ...]


@dataclass(frozen=True)
class ForwardSegment:
    """Home -> a creditor holding one of its segments: send the segment's blocks to another
    creditor's reservation (a creditor-to-creditor move, driven by the home).

    The receiver sends ``KVBlocks(move_id, reservation_id, ...)`` straight from its pool to the
    destination and answers with the destination's ``KVBlocksStored``. It keeps its copy: the
    home switches its block table and only then sends ``FreeSegment`` for the old one.
    """

    TYPE: ClassVar[str] = "forward_segment"
    VERSION: ClassVar[int] = 1

    epoch: int  # epoch of the MoveKV command being carried out
    move_id: int  # the home's id for this move, echoed in KVBlocks
    home_inst_id: int  # the request's home (sender)
    req_id: int  # request
    segment_id: int  # the segment the receiver holds, as the home names it
    dst_inst_id: int  # the creditor that reserved room for the segment
    dst_host: str  # its peer listener's host
    dst_port: int  # its peer listener's port
    reservation_id: int  # from the destination's MoveReserved
    dst_block_ids: tuple[int, ...]  # reserved blocks, one per block of the segment, in order

    def __post_init__(self) -> None:
        _require_not_negative("epoch, move_id, home_inst_id, req_id, segment_id, dst_inst_id and reservation_id",
                              self.epoch, self.move_id, self.home_inst_id, self.req_id, self.segment_id,
                              self.dst_inst_id, self.reservation_id)
        _require(len(self.dst_block_ids) > 0, "a segment has at least one block")
        _require_block_ids(self.dst_block_ids)
        _require(len(self.dst_host) > 0, "dst_host must name a host")
        _require(0 < self.dst_port < 65536, "dst_port must be a TCP port")
        _require(self.dst_inst_id != self.home_inst_id, "the home takes its blocks back another way")


@dataclass(frozen=True)
class MoveKV:
    """gManager -> the request's home: move blocks held on ``src_inst_id`` (``move_kvcache``).

    From the home's own pool (``src_inst_id == home_inst_id``) the oldest ``num_blocks`` full
    blocks move. From a creditor, whole segments move, oldest first, as many as fit in
    ``num_blocks``: the creditor holds each segment under one id.
    """

    TYPE: ClassVar[str] = "move_kv"
    VERSION: ClassVar[int] = 1

    epoch: int  # leader's epoch
    move_id: int  # unique per epoch
    home_inst_id: int  # the request's home
    req_id: int  # request
    src_inst_id: int  # holds the blocks now: the home itself or one of its creditors
    dst_inst_id: int  # instance to move them to
    num_blocks: int  # blocks to move, oldest first (at most, for a creditor's segments)

    def __post_init__(self) -> None:
        _require_not_negative("epoch, move_id, home_inst_id, req_id, src_inst_id and dst_inst_id", self.epoch,
                              self.move_id, self.home_inst_id, self.req_id, self.src_inst_id, self.dst_inst_id)
        _require(self.num_blocks > 0, "num_blocks must be positive")
        _require(self.src_inst_id != self.dst_inst_id, "a move needs two instances")


@dataclass(frozen=True)
class Drain:
    """gManager -> instance: admit nothing new; the gManager moves everything off."""

    TYPE: ClassVar[str] = "drain"
    VERSION: ClassVar[int] = 1

    epoch: int  # leader's epoch
    drain_id: int  # unique per epoch
    inst_id: int  # the instance to drain (the receiver)

    def __post_init__(self) -> None:
        _require_not_negative("epoch, drain_id and inst_id", self.epoch, self.drain_id, self.inst_id)


@dataclass(frozen=True)
class Uncordon:
    """gManager -> instance: admit requests and take blocks again (a drain is called off)."""

    TYPE: ClassVar[str] = "uncordon"
    VERSION: ClassVar[int] = 1

    epoch: int  # leader's epoch
    drain_id: int  # the drain called off
    inst_id: int  # the instance (the receiver)

    def __post_init__(self) -> None:
        _require_not_negative("epoch, drain_id and inst_id", self.epoch, self.drain_id, self.inst_id)


@dataclass(frozen=True)
class Echo:
    """A payload sent back unchanged: link checks and transport measurements."""

    TYPE: ClassVar[str] = "echo"
    VERSION: ClassVar[int] = 1
    TENSORS: ClassVar[tuple[str, ...]] = ("payload",)

    payload: WireArray  # any shape and dtype


@dataclass(frozen=True)
class EchoReply:
    TYPE: ClassVar[str] = "echo_reply"
    VERSION: ClassVar[int] = 1
    TENSORS: ClassVar[tuple[str, ...]] = ("payload",)

    payload: WireArray  # the request's payload


@dataclass(frozen=True)
class SharedMemoryOffer:
    """A transport's first request on a new connection: host buffers of its later requests may
    come as offsets into this file of the receiver's shared-memory directory, which the receiver
    maps read-only (``transport/shared_memory.py``). Ack: mapped. ErrorReply
    (shared_memory_unavailable): not (another host, another user, turned off); buffers then
    travel over UCX, as they do where the receiver's CLOCK_MONOTONIC is not the sender's (the
    times after which a frame's buffers there are not read, ``codec``, would not agree)."""

    TYPE: ClassVar[str] = "shared_memory_offer"
    VERSION: ClassVar[int] = 2

    region: str  # file name in the shared-memory directory: infllm-<pid>-<16 hex digits>
    nonce: str  # 32 hex digits: the file's first 16 bytes, which prove it is the sender's
    clock_ns: int  # the sender's CLOCK_MONOTONIC when it made the offer, ns

    def __post_init__(self) -> None:
        _require(len(self.region) <= 64 and len(self.nonce) <= 64, "region and nonce are short names")
        _require(self.clock_ns >= 0, "clock_ns >= 0")


@dataclass(frozen=True)
class HeaderRingOffer:
    """A transport's request on a new connection: the headers of its later frames may come
    through this ring of the receiver's shared-memory directory (``transport/header_ring.py``),
    with a doorbell beside it. HeaderRingAccepted: the receiver reads the ring, and offers its
    own for its replies. Ack: it reads the ring; its replies stay on UCX. ErrorReply
    (shared_memory_unavailable): not (another host, another user, turned off); headers then
    travel over UCX."""

    TYPE: ClassVar[str] = "header_ring_offer"
    VERSION: ClassVar[int] = 1

    ring: str  # file name in the shared-memory directory: infllm-<pid>-<16 hex digits>.ring
    nonce: str  # 32 hex digits: the file's first 16 bytes, which prove it is the sender's

    def __post_init__(self) -> None:
        _require(len(self.ring) <= 64 and len(self.nonce) <= 64, "ring and nonce are short names")


@dataclass(frozen=True)
class HeaderRingAccepted:
    """The answer to HeaderRingOffer: the offered ring is read, and the replies' headers may
    come through this ring once the requester has said it opened it (HeaderRingOpened)."""

    TYPE: ClassVar[str] = "header_ring_accepted"
    VERSION: ClassVar[int] = 1

    ring: str  # as HeaderRingOffer's
    nonce: str

    def __post_init__(self) -> None:
        _require(len(self.ring) <= 64 and len(self.nonce) <= 64, "ring and nonce are short names")


@dataclass(frozen=True)
class HeaderRingOpened:
    """The requester opened the ring of HeaderRingAccepted. Ack (over UCX); the replies after
    it come through the ring."""

    TYPE: ClassVar[str] = "header_ring_opened"
    VERSION: ClassVar[int] = 1


@dataclass(frozen=True)
class DevicePoolOffer:
    """A transport's request on a connection, before its first move from a device pool: rows of
    this pool may come as their ids (``device_pools``), which the receiver copies out of the
    pool mapped through CUDA IPC. Ack: mapped. ErrorReply (device_pool_unavailable): not
    (another host, no peer access, turned off, a receiver on the host); the rows then travel
    gathered, over UCX. The fields are those of ``torch.multiprocessing``'s CUDA sharing."""

    TYPE: ClassVar[str] = "device_pool_offer"
    VERSION: ClassVar[int] = 1

    pool_id: int  # the sender's id for the pool on this connection, which frames name
    device: int  # the sender's CUDA device index (for its logs: the receiver opens the pool under its own)
    handle: str  # hex: the CUDA IPC handle of the allocation the pool lies in
    storage_bytes: int  # the pool's storage, bytes
    storage_offset_bytes: int  # where the storage starts in the allocation, bytes
    ref_counter: str  # hex: the shared file of torch's count of the storage's users
    ref_counter_offset: int  # the count's place in it
    event: str  # hex: a CUDA IPC event after the pool's last writes when it was shared, or ""
    event_sync_required: bool  # whether the receiver waits for that event
    dtype: str  # the pool's dtype name
    shape: tuple[int, ...]  # [num_rows, *row_shape], elements
    offset: int  # the pool's first element in its storage, elements

    def __post_init__(self) -> None:
        _require(self.pool_id >= 0 and self.device >= 0, "pool_id and device are >= 0")
        _require(all(len(h) <= 512 for h in (self.handle, self.ref_counter, self.event)), "handles are short")
        _require(min(self.storage_bytes, self.storage_offset_bytes, self.ref_counter_offset, self.offset) >= 0,
                 "sizes and offsets are >= 0")
        _require(1 <= len(self.shape) <= 8 and all(d >= 0 for d in self.shape) and self.shape[0] > 0,
                 "a pool has 1 to 8 dimensions and rows")
        _require(len(self.dtype) <= 16, "dtype is a short name")


# --- the step protocol: one host message per step, the layers through a mailbox -----------------


@dataclass(frozen=True)
class StepMailboxOpen:
    """Home -> creditor on the same host: make a mailbox for this home's steps (``step_mailbox``).
    Answer: ``StepMailboxOpened``; ErrorReply (step_mailbox_unavailable) where the creditor
    cannot make or share one (another host, turned off): the home then attends by messages."""

    TYPE: ClassVar[str] = "step_mailbox_open"
    VERSION: ClassVar[int] = 1

    home_inst_id: int  # sender
    creditor_inst_id: int  # receiver
    num_layers: int  # layers, one query slot and one result slot each
    max_rows: int  # query rows a step may send, rows
    num_heads: int  # query heads
    head_dim: int  # elements
    dtype: str  # the queries' and outputs' dtype name
    host_id: str  # the home's host (its boot id): a mailbox is shared only on one host
    # The home's NCCL unique id, hex (transport/nccl_link.py): asks for a link of two NCCL ranks
    # instead of shared memory (a creditor on another host). "" for a shared mailbox.
    nccl_id: str = ""

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id and creditor_inst_id", self.home_inst_id, self.creditor_inst_id)
        _require(0 < self.num_layers <= 4096 and 0 < self.max_rows <= 65536, "num_layers and max_rows out of range")
        _require(0 < self.num_heads <= 1024 and 0 < self.head_dim <= 1024, "num_heads and head_dim out of range")
        _require(len(self.host_id) <= 128 and len(self.dtype) <= 32, "host_id and dtype are short")
        _require(self.nccl_id == "" or _NCCL_ID.fullmatch(self.nccl_id) is not None,
                 "nccl_id is 256 hex digits or empty")


@dataclass(frozen=True)
class StepMailboxOpened:
    """Creditor -> home: the mailbox, made in the creditor's memory and shared through CUDA IPC
    (``device``: one offer of a uint8 tensor of ``nbytes``) or, for a creditor on the host, a
    shared-memory file (``host_path``); or, answering an open with ``nccl_id``, kept in the
    creditor's memory alone and reached through the NCCL link (``nccl``), which the creditor
    is making as it answers."""

    TYPE: ClassVar[str] = "step_mailbox_opened"
    VERSION: ClassVar[int] = 1

    mailbox_id: int  # the creditor's id for it, which every StepBegin names
    nbytes: int  # the mailbox's size, bytes (its layout follows from the open request)
    device: tuple[DevicePoolOffer, ...]  # one offer for a device mailbox, none for a host one
    host_path: str  # the shared-memory file of a host mailbox, "" for a device one
    nccl: bool = False  # reached through the NCCL link the open asked for: no offer, no path

    def __post_init__(self) -> None:
        _require(self.mailbox_id > 0 and self.nbytes > 0, "mailbox_id and nbytes are > 0")
        _require((len(self.device) == 1) + bool(self.host_path) + bool(self.nccl) == 1,
                 "one of a device offer, a host path and an NCCL link")
        _require(len(self.host_path) <= 4096, "host_path is short")


@dataclass(frozen=True)
class StepBegin:
    """Home -> creditor, once per decode step: run every layer of this step for these rows.

    The creditor queues the step at once (on a GPU one graph launch on a stream of this home's
    mailbox) and answers ``Ack``; each layer then waits on the mailbox for its query and leaves
    its partial output and log-sum-exp there, with no host on either side. ErrorReply
    (step_refused): the slices name segments not held here, or the mailbox is gone."""

    TYPE: ClassVar[str] = "step_begin"
    VERSION: ClassVar[int] = 1

    home_inst_id: int  # sender
    creditor_inst_id: int  # receiver
    mailbox_id: int  # from StepMailboxOpened
    step_id: int  # the home's engine step
    num_layers: int  # layers of the step, all of the mailbox's
    slices: tuple[AttendSlice, ...]  # requests in row order, as in AttendRequest
    num_rows: int  # query rows of the step, rows
    # Steps the creditor keeps queued past this one, for the same slices and rows (0 or 1): the
    # home's next step of the same slices then finds its layers queued before its StepBegin
    # arrives. A home awaits the Ack of a StepBegin whose slices or rows differ from the last
    # one's before it writes any query of that step (docs/design.md, "Steps queued ahead").
    ahead: int = 0
    # Rows of each layer's query and result on an NCCL link (>= num_rows: the home's graph
    # sends a padded batch, and a receive must be the size of its send); 0 for a mailbox.
    wire_rows: int = 0

    def __post_init__(self) -> None:
        if (self.home_inst_id | self.creditor_inst_id | self.step_id | self.mailbox_id) < 0:
            raise ValueError("home_inst_id, creditor_inst_id, mailbox_id and step_id must be >= 0")
        _require(self.num_layers > 0, "num_layers must be > 0")
        _require(self.num_rows > 0, "a step has at least one row")
        _require(0 <= self.ahead <= MAX_STEPS_AHEAD, f"ahead is 0 .. {MAX_STEPS_AHEAD}")
        _require(self.wire_rows == 0 or self.wire_rows >= self.num_rows, "wire_rows is 0 or >= num_rows")
        _require_rows_covered(self.slices, self.num_rows)


# Steps a creditor may keep queued past the current one (StepBegin.ahead).
MAX_STEPS_AHEAD = 1
# An NCCL unique id (ncclUniqueId, 128 bytes) as StepMailboxOpen carries it.
_NCCL_ID = re.compile(r"[0-9a-f]{256}")


@dataclass(frozen=True)
class StepStandDown:
    """Home -> creditor: the steps queued ahead for this mailbox will not be used (the home's
    step no longer needs this creditor, or it went idle); they are let go and their slots made
    empty. Answered ``Ack``; the mailbox stays open. ErrorReply (step_refused): not open here."""

    TYPE: ClassVar[str] = "step_stand_down"
    VERSION: ClassVar[int] = 1

    home_inst_id: int  # sender
    mailbox_id: int
    step_id: int  # the home's last step that used the mailbox

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id, mailbox_id and step_id", self.home_inst_id, self.mailbox_id,
                              self.step_id)


@dataclass(frozen=True)
class StepMailboxClose:
    """Home -> creditor: the mailbox is no longer used (one-way; a creditor also frees one
    whose step timed out, and one whose home died)."""

    TYPE: ClassVar[str] = "step_mailbox_close"
    VERSION: ClassVar[int] = 1

    home_inst_id: int  # sender
    mailbox_id: int  # from StepMailboxOpened

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id and mailbox_id", self.home_inst_id, self.mailbox_id)


@dataclass(frozen=True)
class APBChunkPrefill:
    """Home -> each other host of an APB prefill: compute chunk ``rank`` of the document into
    the blocks reserved for it here (a ``TryMoveKV`` made the reservation), meeting the other
    hosts per layer through ``APBPassing``; answered with ``APBChunkDone`` once the chunk's KV
    is this instance's held segment of the request, or an ``ErrorReply``."""

    TYPE: ClassVar[str] = "apb_chunk_prefill"
    VERSION: ClassVar[int] = 1
    TENSORS: ClassVar[tuple[str, ...]] = ("token_ids",)

    home_inst_id: int  # the request's home (sender)
    req_id: int  # request id, unique per home instance
    home_run: int  # the home's run (its membership record's run_id)
    rank: int  # this host's chunk, 0-based, in document order
    host_inst_ids: tuple[int, ...]  # every host, in rank order (the home is one of them)
    reservation_id: int  # the blocks here that the chunk's KV fills, in token order
    token_start: int  # the chunk's first position, a multiple of block_size
    anchor_len: int  # the anchor's length; on ranks above 0 token_ids begins with those document tokens
    query_len: int  # tokens after the anchor: the query, which scores the passing blocks
    chunk_len: int  # tokens after the query: this host's chunk
    passing_len: int  # keys per KV head each host passes on, per layer (0: none)
    pool_width: int  # scores max-pooled over this many neighbouring keys (odd)
    observe_len: int  # with no query: the chunk's last rows that score its keys
    scorer: str  # "attention" or "random"
    seed: int  # the random scorer's seed
    layer_timeout_ms: int  # the longest a host waits for the others' passing blocks of a layer
    token_ids: WireArray  # [(anchor_len if rank else 0) + query_len + chunk_len] int64

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id, req_id, home_run, rank, reservation_id, token_start, anchor_len, "
                              "query_len, passing_len, seed", self.home_inst_id, self.req_id, self.home_run,
                              self.rank, self.reservation_id, self.token_start, self.anchor_len, self.query_len,
                              self.passing_len, self.seed)
        _require(self.chunk_len > 0, "chunk_len must be positive")
        _require(0 < len(self.host_inst_ids) == len(set(self.host_inst_ids)), "host_inst_ids must be distinct, "
                 "at least one")
        _require(self.rank < len(self.host_inst_ids), "rank must name one of host_inst_ids")
        _require(self.pool_width > 0 and self.pool_width % 2 == 1, "pool_width must be a positive odd number")
        _require(self.observe_len > 0 and self.layer_timeout_ms > 0, "observe_len and layer_timeout_ms must be "
                 "positive")
        _require(self.scorer in ("attention", "random"), "scorer must be 'attention' or 'random'")
        _require(self.anchor_len <= self.token_start + self.chunk_len, "the anchor must lie in the document")
        _require(tuple(self.token_ids.shape) == ((self.anchor_len if self.rank else 0) + self.query_len
                                                 + self.chunk_len,),
                 "token_ids must be [anchor tokens (ranks above 0) + query_len + chunk_len]")


@dataclass(frozen=True)
class APBChunkDone:
    """Host -> home: the chunk's KV is written and held here as the request's segment
    ``token_start // block_size`` (committed from ``reservation_id``)."""

    TYPE: ClassVar[str] = "apb_chunk_done"
    VERSION: ClassVar[int] = 1

    req_id: int  # echoed
    reservation_id: int  # echoed: the held copy's id
    num_tokens: int  # tokens written, the chunk's
    passing_bytes: int  # bytes of passing blocks this host sent, all layers and hosts
    compute_ms: int  # this host's time from the start to the last layer's end

    def __post_init__(self) -> None:
        _require_not_negative("req_id, reservation_id, num_tokens, passing_bytes and compute_ms", self.req_id,
                              self.reservation_id, self.num_tokens, self.passing_bytes, self.compute_ms)


@dataclass(frozen=True)
class APBPassing:
    """Host -> host of one APB prefill: one round of its collectives (the chunk lengths before
    layer 0, then each layer's passing block), answered with ``Ack`` once it is buffered."""

    TYPE: ClassVar[str] = "apb_passing"
    VERSION: ClassVar[int] = 1
    TENSORS: ClassVar[tuple[str, ...]] = ("data",)

    home_inst_id: int  # the request's home
    req_id: int  # request id, unique per home instance
    round: int  # the collective's number in the prefill, from 0
    src_rank: int  # the sender's rank
    data: WireArray  # the sender's tensor for this round (any shape; one dtype and shape per round)

    def __post_init__(self) -> None:
        _require_not_negative("home_inst_id, req_id, round and src_rank", self.home_inst_id, self.req_id,
                              self.round, self.src_rank)


@dataclass(frozen=True)
class Ack:
    """The request was carried out; for requests whose success has nothing more to say."""

    TYPE: ClassVar[str] = "ack"
    VERSION: ClassVar[int] = 1


@dataclass(frozen=True)
class ErrorReply:
    """The frame or request was refused. A protocol refusal also closes the connection."""

    TYPE: ClassVar[str] = "error_reply"
    VERSION: ClassVar[int] = 1

    code: ErrorCode
    detail: str  # human-readable, for logs


Message = (
    Heartbeat | HeartbeatReply | AttendRequest | AttendResult | TryMoveKV | MoveReserved
    | MoveRejected | HoldKV | KVHoldReply | KVBlocks | KVBlocksStored | MoveCommit | FreeSegment | AuditHeld | AuditHeldReply | ForwardSegment | MoveKV
    | Drain | Uncordon | Echo | EchoReply | SharedMemoryOffer | HeaderRingOffer | HeaderRingAccepted
    | HeaderRingOpened | DevicePoolOffer | StepMailboxOpen | StepMailboxOpened | StepBegin | StepStandDown | StepMailboxClose | APBChunkPrefill
    | APBChunkDone | APBPassing | Ack
    | ErrorReply
)

MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (
        Heartbeat, HeartbeatReply, AttendRequest, AttendResult, TryMoveKV, MoveReserved,
        MoveRejected, HoldKV, KVHoldReply, KVBlocks, KVBlocksStored, MoveCommit, FreeSegment, AuditHeld, AuditHeldReply, ForwardSegment, MoveKV,
        Drain, Uncordon, Echo, EchoReply, SharedMemoryOffer, HeaderRingOffer, HeaderRingAccepted,
        HeaderRingOpened, DevicePoolOffer, StepMailboxOpen, StepMailboxOpened, StepBegin, StepStandDown, StepMailboxClose, APBChunkPrefill,
        APBChunkDone, APBPassing, Ack,
        ErrorReply,
    )
}


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def _require_not_negative(what: str, *values: int) -> None:
    if min(values) < 0:
        raise ValueError(f"{what} must be >= 0")


def _require_block_ids(block_ids: tuple[int, ...]) -> None:
    """Block ids of one reservation: each >= 0, none twice."""
    if block_ids and (min(block_ids) < 0 or len(set(block_ids)) != len(block_ids)):
        raise ValueError("block ids must be >= 0 and distinct")


def _require_rows_covered(slices: tuple[AttendSlice, ...], num_rows: int) -> None:
    next_row = 0
    for s in slices:
        if s.row_start != next_row or s.num_rows <= 0:
            raise ValueError("slices must cover q's rows in order, each at least one row")
        # One OR: negative where any is.
        if (s.num_tokens | s.req_id | s.segment_id) < 0:
            raise ValueError("req_id, segment_id and num_tokens must not be negative")
        next_row += s.num_rows
    _require(next_row == num_rows, "slices must cover every row of q")


def _dtype_name(dtype: object) -> str:
    # numpy and cupy: dtype.name; torch: "torch.float32"
    return getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")
