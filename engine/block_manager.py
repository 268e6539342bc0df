"""Block accounting: which KV blocks of which instance hold which tokens of each request.

Pure logic: no tensors, no I/O. The engine asks it where to write new K and V (always the home
instance), which blocks to attend over on each instance, and how to lend a request's oldest
blocks to a creditor or take them back; it copies the data itself between ``lend``/``take_back``
and ``commit_move``.

A request's block table is a list of :class:`Segment` in token order. Every segment starts at a
multiple of ``block_size``; consecutive segments on one instance are merged. New tokens go into
the last segment, which is on the home instance (a new home segment is opened when the last one
was lent out).

An instance lost with the blocks it held (a creditor killed) leaves lost ranges in the tables of
the requests that had segments there: :meth:`BlockManager.drop_instance` takes those segments
out, and the request recomputes the ranges in token order (:meth:`BlockManager.fill_lost` gives
each chunk home blocks) before it decodes again. A table with a lost range has a gap there:
nothing attends over it, and nothing but a recompute chunk may run for the request meanwhile.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np


class OutOfBlocks(RuntimeError):
    """An allocation or move asked for more free blocks than the instance has."""


@dataclass(frozen=True)
class Segment:
    """A run of one request's tokens whose K and V sit in blocks of one instance."""

    instance_id: int
    block_ids: tuple[int, ...]  # in token order
    token_start: int  # absolute position of the first token, a multiple of block_size
    num_tokens: int  # tokens with a slot here (at most len(block_ids) * block_size)
    # A peer's id for its copy (the reservation it was committed from), so that a free names
    # this copy and no later one under the same segment id; 0 in this process's own pools.
    copy_id: int = 0

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_tokens


@dataclass(frozen=True)
class SegmentMove:
    """A pending move of a run of blocks between instances, to be copied then committed.

    ``src_block_ids[i]`` is copied into ``dst_block_ids[i]``; the tokens are
    ``[token_start, token_start + num_tokens)``.
    """

    request_id: str
    src_instance_id: int
    src_block_ids: tuple[int, ...]
    dst_instance_id: int
    dst_block_ids: tuple[int, ...]
    token_start: int
    num_tokens: int
    dst_copy_id: int = 0  # the destination peer's id for its copy (``Segment.copy_id``)

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_tokens


class BlockAllocator:
    """Free list of one instance's pool; hands out the lowest free ids first."""

    def __init__(self, instance_id: int, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"instance {instance_id}: num_blocks must be positive, got {num_blocks}")
        self.instance_id = instance_id
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise OutOfBlocks(
                f"instance {self.instance_id} has {len(self._free)} free blocks, {num_blocks} were asked for"
            )
        ids = [heapq.heappop(self._free) for _ in range(num_blocks)]
        self._used.update(ids)
        return ids

    def allocate_contiguous(self, num_blocks: int) -> list[int]:
        """``num_blocks`` consecutive ids (the lowest such run) where the free list has one,
        else the lowest free ids: a peer's data then lands as one run (one message)."""
        if num_blocks > len(self._free):
            raise OutOfBlocks(
                f"instance {self.instance_id} has {len(self._free)} free blocks, {num_blocks} were asked for"
            )
        # Sorted runs found in numpy: a creditor's pool may have 10^5 free blocks, and this
        # runs on its event loop.
        free = np.sort(np.fromiter(self._free, dtype=np.int64, count=len(self._free)))
        breaks = np.flatnonzero(np.diff(free) != 1) + 1
        starts = np.concatenate(([0], breaks))
        long_enough = np.flatnonzero(np.diff(np.append(starts, len(free))) >= num_blocks)
        if long_enough.size:
            start = int(starts[long_enough[0]])
            ids = free[start:start + num_blocks].tolist()
            self._free = np.concatenate((free[:start], free[start + num_blocks:])).tolist()  # sorted: a heap
            self._used.update(ids)
            return ids
        return self.allocate(num_blocks)

    def free(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if block_id not in self._used:
                raise ValueError(f"instance {self.instance_id}: block {block_id} is not allocated")
            self._used.remove(block_id)
            heapq.heappush(self._free, block_id)


class BlockManager:
    """Per-request block tables over one home pool and any number of creditor pools."""

    def __init__(self, block_size: int, pool_blocks: Sequence[int], home_instance_id: int = 0,
                 on_remote_free: Callable[[str, Segment], None] | None = None) -> None:
        """Args:
            block_size: tokens per block.
            pool_blocks: blocks of each pool in this process; the index is the instance id.
            home_instance_id: the pool new tokens are written to.
            on_remote_free: called with each segment on an instance outside this process (a
                peer daemon) when its request is freed: the caller tells that peer.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0 <= home_instance_id < len(pool_blocks):
            raise ValueError(f"home_instance_id {home_instance_id} is not one of the {len(pool_blocks)} pools")
        self.block_size = block_size
        self.home_instance_id = home_instance_id
        self._allocators = [BlockAllocator(i, n) for i, n in enumerate(pool_blocks)]
        self._tables: dict[str, list[Segment]] = {}
        self._pending: dict[tuple[str, int], SegmentMove] = {}  # (request, token_start) -> move
        # request -> token ranges [start, end) whose KV was lost, in token order, not adjacent
        self._lost: dict[str, list[tuple[int, int]]] = {}
        self._on_remote_free = on_remote_free

    # ---- queries -------------------------------------------------------------------------
    @property
    def instance_ids(self) -> range:
        return range(len(self._allocators))

    def is_local(self, instance_id: int) -> bool:
        """Whether the instance's pool is in this process (else its blocks are a peer's to count)."""
        return 0 <= instance_id < len(self._allocators)

    def num_free_blocks(self, instance_id: int) -> int:
        return self._allocator(instance_id).num_free

    def num_total_blocks(self, instance_id: int | None = None) -> int:
        """Blocks of one pool, or of all pools together."""
        if instance_id is None:
            return sum(a.num_blocks for a in self._allocators)
        return self._allocator(instance_id).num_blocks

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> tuple[Segment, ...]:
        return tuple(self._tables.get(request_id, ()))

    def counts_on(self, request_id: str, token_start: int, instance_id: int, copy_id: int) -> bool:
        """Whether the request counts on the copy ``copy_id`` of a segment starting at
        ``token_start`` in the pool of ``instance_id``: its table points there, or a pending move
        lands it there (the copy may be committed there before the table switches)."""
        if any(s.token_start == token_start and s.instance_id == instance_id and s.copy_id == copy_id
               for s in self._tables.get(request_id, ())):
            return True
        move = self._pending.get((request_id, token_start))
        return move is not None and move.dst_instance_id == instance_id and move.dst_copy_id == copy_id

    def is_split(self, request_id: str) -> bool:
        """Whether some of the request's KV lives outside the home pool."""
        return any(s.instance_id != self.home_instance_id for s in self._tables.get(request_id, ()))

    def num_tokens(self, request_id: str) -> int:
        """Tokens of the request that have a KV slot (a lost range at the end counts: its
        slots come back as it is recomputed)."""
        table = self._tables.get(request_id)
        lost = self._lost.get(request_id)
        return max(table[-1].token_end if table else 0, lost[-1][1] if lost else 0)

    # ---- lost ranges ---------------------------------------------------------------------
    def drop_instance(self, instance_id: int) -> dict[str, list[Segment]]:
        """The instance is gone with the blocks it held: every segment there becomes a lost
        range of its request, and pending moves to or from it are cancelled. Blocks of a pool in
        this process go back to its free list. Returns the segments lost, per request."""
        for move in [m for m in self._pending.values() if instance_id in (m.src_instance_id, m.dst_instance_id)]:
            self.abort_move(move)
        lost: dict[str, list[Segment]] = {}
        for request_id, table in self._tables.items():
            gone = [s for s in table if s.instance_id == instance_id]
            if not gone:
                continue
            self._tables[request_id] = [s for s in table if s.instance_id != instance_id]
            if self.is_local(instance_id):
                for segment in gone:
                    self._allocator(instance_id).free(segment.block_ids)
            ranges = sorted(self._lost.get(request_id, []) + [(s.token_start, s.token_end) for s in gone])
            merged: list[tuple[int, int]] = []
            for start, end in ranges:
                if merged and merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], end)
                else:
                    merged.append((start, end))
            self._lost[request_id] = merged
            lost[request_id] = gone
        return lost

    def lost_range(self, request_id: str) -> tuple[int, int] | None:
        """The request's first lost range ``(token_start, token_end)``, the next to recompute;
        None when it has none."""
        ranges = self._lost.get(request_id)
        return ranges[0] if ranges else None

    def has_lost(self, request_id: str) -> bool:
        return request_id in self._lost

    def num_lost_tokens(self, request_id: str) -> int:
        return sum(end - start for start, end in self._lost.get(request_id, ()))

    def num_lost_blocks(self, request_id: str) -> int:
        """Home blocks the request's lost ranges take when recomputed."""
        return sum(-(-(end - start) // self.block_size) for start, end in self._lost.get(request_id, ()))

    def fill_end(self, request_id: str, num_tokens: int) -> int:
        """Where a recompute chunk of at most ``num_tokens`` tokens from the first lost range's
        start ends: at the range's end, or at a block boundary before it (the rest of the range
        then starts a block); the start itself when not one block fits."""
        start, end = self._lost[request_id][0]
        if start + num_tokens >= end:
            return end
        return start + num_tokens // self.block_size * self.block_size

    def can_fill(self, request_id: str, end: int) -> bool:
        """Whether the home pool has the blocks for ``fill_lost(request_id, end)``."""
        start, _ = self._lost[request_id][0]
        return -(-(end - start) // self.block_size) <= self.num_free_blocks(self.home_instance_id)

    def fill_lost(self, request_id: str, end: int) -> Segment:
        """Give the first lost range's tokens up to ``end`` home blocks (a ``fill_end``): their
        K and V are then written by a recompute chunk. Returns the new home segment."""
        ranges = self._lost[request_id]
        start, stop = ranges[0]
        if not start < end <= stop or (end < stop and end % self.block_size):
            raise ValueError(f"request {request_id}: cannot recompute [{start}, {end}) of its lost range "
                             f"[{start}, {stop}): the end must be past the start, in the range and on a block "
                             "boundary unless it is the range's end")
        block_ids = tuple(self._allocator(self.home_instance_id).allocate(-(-(end - start) // self.block_size)))
        segment = Segment(self.home_instance_id, block_ids, start, end - start)
        table = self._tables[request_id]
        index = next((i for i, s in enumerate(table) if s.token_start > start), len(table))
        table.insert(index, segment)
        self._tables[request_id] = _coalesce(table, self.is_local)
        if end == stop:
            del ranges[0]
            if not ranges:
                del self._lost[request_id]
        else:
            ranges[0] = (end, stop)
        return segment

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New home blocks that ``allocate(request_id, num_tokens)`` would take."""
        if num_tokens <= self.num_tokens(request_id):
            return 0
        return -(-max(0, num_tokens - self._home_tail_capacity(request_id)) // self.block_size)

    def _home_tail_capacity(self, request_id: str) -> int:
        """Tokens the request's blocks give slots for without a new block: up to the end of its
        home tail's last block (where the tail is lent out, only those it has)."""
        table = self._tables.get(request_id, [])
        have = table[-1].token_end if table else 0
        tail = table[-1] if table and table[-1].instance_id == self.home_instance_id else None
        return (tail.token_start + len(tail.block_ids) * self.block_size) if tail else have

    def max_allocatable_tokens(self, request_id: str) -> int:
        """The most tokens in all that ``allocate(request_id, ...)`` can give slots for now: the
        room left in its home tail and in the home pool's free blocks."""
        return self._home_tail_capacity(request_id) + self.num_free_blocks(self.home_instance_id) * self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether the home pool can give ``request_id`` slots for ``num_tokens`` tokens in all."""
        return self.blocks_needed(request_id, num_tokens) <= self.num_free_blocks(self.home_instance_id)

    def allocate(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's home tail so that its first ``num_tokens`` tokens have slots."""
        needed = self.blocks_needed(request_id, num_tokens)
        new_ids = tuple(self._allocator(self.home_instance_id).allocate(needed))
        table = self._tables.setdefault(request_id, [])
        have = table[-1].token_end if table else 0
        if num_tokens <= have:
            return
        if table and table[-1].instance_id == self.home_instance_id:
            tail = table[-1]
            table[-1] = Segment(tail.instance_id, tail.block_ids + new_ids, tail.token_start, num_tokens - tail.token_start)
        else:
            table.append(Segment(self.home_instance_id, new_ids, have, num_tokens - have))

    def free(self, request_id: str) -> None:
        """Return every block of the request, on every instance; pending moves are cancelled."""
        for key in [k for k in self._pending if k[0] == request_id]:
            self.abort_move(self._pending[key])
        self._lost.pop(request_id, None)
        for segment in self._tables.pop(request_id, []):
            if self.is_local(segment.instance_id):
                self._allocator(segment.instance_id).free(segment.block_ids)
            elif self._on_remote_free is not None:
                self._on_remote_free(request_id, segment)

    def adopt(self, request_id: str, segments: Sequence[Segment]) -> None:
        """Give a new request a table of segments whose KV is already written (an APB prefill
        computed each chunk where it lies): on peers, copies they hold (``copy_id`` positive);
        in this process's pools, blocks taken with :meth:`reserve_blocks`, which become the
        request's. The segments follow each other in token order from token 0, each starting on
        a block and with blocks enough for its tokens; the last is the home tail the request
        goes on writing into, if it is in the home pool."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} has a block table already")
        if not segments:
            raise ValueError("adopt needs at least one segment")
        expected_start = 0
        for segment in segments:
            if segment.token_start != expected_start:
                raise ValueError(f"request {request_id}: segment at token {segment.token_start}, expected one at "
                                 f"{expected_start} (segments must follow each other from token 0)")
            if segment.token_start % self.block_size:
                raise ValueError(f"segment at token {segment.token_start} does not start on a block")
            if not 0 < segment.num_tokens <= len(segment.block_ids) * self.block_size:
                raise ValueError(f"segment at token {segment.token_start}: {segment.num_tokens} tokens in "
                                 f"{len(segment.block_ids)} blocks of {self.block_size}")
            if segment is not segments[-1] and segment.num_tokens != len(segment.block_ids) * self.block_size:
                raise ValueError(f"segment at token {segment.token_start} is not full but another follows it")
            if not self.is_local(segment.instance_id):
                _require_copy_id(segment.copy_id)
            expected_start = segment.token_end
        self._tables[request_id] = list(segments)

    # ---- blocks held for other instances --------------------------------------------------
    def reserve_home_blocks(self, num_blocks: int) -> list[int] | None:
        """Take home blocks outside every table (a peer's segment held here); None if too few."""
        return self.reserve_blocks(self.home_instance_id, num_blocks)

    def reserve_blocks(self, instance_id: int, num_blocks: int) -> list[int] | None:
        """Take blocks of a pool of this process outside every table; None if too few."""
        allocator = self._allocator(instance_id)
        if num_blocks > allocator.num_free:
            return None
        return allocator.allocate_contiguous(num_blocks)

    def release_home_blocks(self, block_ids: Iterable[int]) -> None:
        """Give back blocks taken with :meth:`reserve_home_blocks`."""
        self._allocator(self.home_instance_id).free(block_ids)

    # ---- slots ---------------------------------------------------------------------------
    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Home-pool slots (``block_id * block_size + offset``) of positions ``[start, end)``,
        which one home segment must hold (the tail, or a lost range being recomputed)."""
        table = self._tables[request_id]
        segment = table[-1]
        if not segment.token_start <= start < segment.token_end:
            segment = next((s for s in table if s.token_start <= start < s.token_end), segment)
        if segment.instance_id != self.home_instance_id or start < segment.token_start or end > segment.token_end:
            raise ValueError(
                f"request {request_id}: positions [{start}, {end}) are not in one home segment "
                f"([{segment.token_start}, {segment.token_end}) is on instance {segment.instance_id})"
            )
        slots = []
        for pos in range(start, end):
            offset = pos - segment.token_start
            slots.append(segment.block_ids[offset // self.block_size] * self.block_size + offset % self.block_size)
        return slots

    # ---- lending -------------------------------------------------------------------------
    def num_lendable_blocks(self, request_id: str, num_written: int) -> int:
        """Oldest home blocks of the request that are full of written tokens (so may move)."""
        for segment in self._tables.get(request_id, []):
            if segment.instance_id != self.home_instance_id:
                continue
            if (request_id, segment.token_start) in self._pending:
                return 0
            full = (min(num_written, segment.token_end) - segment.token_start) // self.block_size
            return max(0, full)
        return 0

    def can_lend(self, request_id: str, num_blocks: int, dst_instance_id: int, num_written: int) -> bool:
        return (
            num_blocks > 0
            and dst_instance_id != self.home_instance_id
            and num_blocks <= self.num_lendable_blocks(request_id, num_written)
            and num_blocks <= self.num_free_blocks(dst_instance_id)
        )

    def lend(self, request_id: str, num_blocks: int, dst_instance_id: int, num_written: int) -> SegmentMove:
        """Reserve blocks on a creditor for the request's oldest ``num_blocks`` home blocks.

        ``num_written`` is how many of the request's tokens have K and V written; only full,
        written blocks move. The table changes at :meth:`commit_move`.
        """
        if not self.can_lend(request_id, num_blocks, dst_instance_id, num_written):
            raise OutOfBlocks(
                f"request {request_id}: cannot lend {num_blocks} blocks to instance {dst_instance_id} "
                f"({self.num_lendable_blocks(request_id, num_written)} lendable, "
                f"{self.num_free_blocks(dst_instance_id)} free there)"
            )
        segment = next(s for s in self._tables[request_id] if s.instance_id == self.home_instance_id)
        dst_ids = tuple(self._allocator(dst_instance_id).allocate(num_blocks))
        move = SegmentMove(
            request_id, self.home_instance_id, segment.block_ids[:num_blocks], dst_instance_id, dst_ids,
            segment.token_start, num_blocks * self.block_size,
        )
        self._pending[(request_id, move.token_start)] = move
        return move

    def lend_to_remote(self, request_id: str, dst_instance_id: int, dst_block_ids: Sequence[int],
                       num_written: int, *, copy_id: int) -> SegmentMove:
        """Like :meth:`lend`, to a peer's pool whose blocks ``dst_block_ids`` that peer reserved
        (``copy_id``: the peer's id for the copy, its reservation's, positive).

        The peer's blocks are its own to count: this process tracks only the table.
        """
        if self.is_local(dst_instance_id):
            raise ValueError(f"instance {dst_instance_id} is a pool of this process: use lend")
        _require_copy_id(copy_id)
        num_blocks = len(dst_block_ids)
        lendable = self.num_lendable_blocks(request_id, num_written)
        if not 0 < num_blocks <= lendable:
            raise OutOfBlocks(f"request {request_id}: cannot lend {num_blocks} blocks ({lendable} lendable)")
        segment = next(s for s in self._tables[request_id] if s.instance_id == self.home_instance_id)
        if (request_id, segment.token_start) in self._pending:
            raise ValueError(f"request {request_id}: its blocks at token {segment.token_start} are already moving")
        move = SegmentMove(
            request_id, self.home_instance_id, segment.block_ids[:num_blocks], dst_instance_id, tuple(dst_block_ids),
            segment.token_start, num_blocks * self.block_size, copy_id,
        )
        self._pending[(request_id, move.token_start)] = move
        return move

    def relocate_remote(self, request_id: str, token_start: int, src_instance_id: int, dst_instance_id: int,
                        dst_block_ids: Sequence[int], *, copy_id: int, src_copy_id: int) -> Segment:
        """Point a segment held by one peer at the copy another peer now holds; returns it.

        The creditor-to-creditor move's switch: the home calls it once ``dst_instance_id``
        committed the copy, between steps. Peer segments are never coalesced (each peer holds a
        segment under its own id, the first block), and no block of this process changes hands.
        ``src_copy_id``: the copy the move was made from. Another copy at the same place (the
        request preempted, prefilled again and spilled to the same peer while the move was
        committed) is not the one moved, and stays.
        Raises KeyError for an unknown request, ValueError when the table has no such segment
        on ``src_instance_id``, it is another copy or the block counts differ.
        """
        if self.is_local(src_instance_id) or self.is_local(dst_instance_id):
            raise ValueError(f"instances {src_instance_id} and {dst_instance_id} must both be peers of this process")
        if src_instance_id == dst_instance_id:
            raise ValueError(f"a relocation needs two peers, got {src_instance_id} twice")
        _require_copy_id(copy_id)
        table = self._tables[request_id]
        index = next((i for i, s in enumerate(table)
                      if s.token_start == token_start and s.instance_id == src_instance_id), None)
        if index is None:
            raise ValueError(f"request {request_id} has no segment at token {token_start} on instance {src_instance_id}")
        if (request_id, token_start) in self._pending:
            raise ValueError(f"request {request_id}: its segment at token {token_start} is already moving")
        source = table[index]
        if source.copy_id != src_copy_id:
            raise ValueError(f"request {request_id}: its segment at token {token_start} on instance {src_instance_id} "
                             f"is copy {source.copy_id} now, not the moved copy {src_copy_id}")
        if len(dst_block_ids) != len(source.block_ids):
            raise ValueError(f"request {request_id}: {len(dst_block_ids)} blocks for a segment of "
                             f"{len(source.block_ids)}")
        moved = Segment(dst_instance_id, tuple(dst_block_ids), source.token_start, source.num_tokens, copy_id)
        table[index] = moved
        return moved

    def take_back(self, request_id: str, segment_index: int) -> SegmentMove:
        """Reserve home blocks for a lent segment, to bring its KV back home."""
        table = self._tables[request_id]
        segment = table[segment_index]
        if segment.instance_id == self.home_instance_id:
            raise ValueError(f"request {request_id}: segment {segment_index} is already on the home instance")
        if (request_id, segment.token_start) in self._pending:
            raise ValueError(f"request {request_id}: segment {segment_index} is already moving")
        dst_ids = tuple(self._allocator(self.home_instance_id).allocate(len(segment.block_ids)))
        move = SegmentMove(
            request_id, segment.instance_id, segment.block_ids, self.home_instance_id, dst_ids,
            segment.token_start, segment.num_tokens,
        )
        self._pending[(request_id, move.token_start)] = move
        return move

    def commit_move(self, move: SegmentMove) -> None:
        """The data is in the destination blocks: switch the table, free the source blocks."""
        key = (move.request_id, move.token_start)
        self._require_pending(move)
        table = self._tables[move.request_id]
        index = next((i for i, s in enumerate(table) if s.token_start == move.token_start
                      and s.block_ids[:len(move.src_block_ids)] == move.src_block_ids), None)
        if index is None:
            raise ValueError(f"move of request {move.request_id} at token {move.token_start}: "
                             "its source segment is no longer in the table")
        del self._pending[key]
        source = table[index]
        moved = Segment(move.dst_instance_id, move.dst_block_ids, move.token_start, move.num_tokens, move.dst_copy_id)
        rest = source.block_ids[len(move.src_block_ids):]
        pieces = [moved]
        if rest:
            pieces.append(Segment(source.instance_id, rest, move.token_end, source.token_end - move.token_end,
                                  source.copy_id))
        table[index:index + 1] = pieces
        self._tables[move.request_id] = _coalesce(table, self.is_local)
        if self.is_local(move.src_instance_id):
            self._allocator(move.src_instance_id).free(move.src_block_ids)

    def abort_move(self, move: SegmentMove) -> None:
        """Give back the destination blocks of a move that will not happen."""
        self._require_pending(move)
        del self._pending[(move.request_id, move.token_start)]
        if self.is_local(move.dst_instance_id):
            self._allocator(move.dst_instance_id).free(move.dst_block_ids)

    def _require_pending(self, move: SegmentMove) -> None:
        """ValueError unless ``move`` itself (not another at the same place) is pending; a stale
        move leaves the pending one as it is."""
        if self._pending.get((move.request_id, move.token_start)) is not move:
            raise ValueError(f"move of request {move.request_id} at token {move.token_start} is not pending")

    def plan_spill(self, num_blocks: int, num_written: dict[str, int]) -> list[tuple[str, int, int]]:
        """Choose lends that free ``num_blocks`` home blocks: ``[(request_id, num_blocks, dst)]``.

        The requests with the most lendable blocks go first, each to the creditor with the most
        free blocks, then to the next while it has lendable blocks left (a long request alone
        may need the room of several). The lends of one request are in token order: each is to
        be committed before the next is made. Returns what is possible, which may free fewer
        blocks than asked.
        """
        free = {i: self.num_free_blocks(i) for i in self.instance_ids if i != self.home_instance_id}
        lendable = sorted(
            ((self.num_lendable_blocks(r, n), r) for r, n in num_written.items()), key=lambda x: (-x[0], x[1])
        )
        plan = []
        for count, request_id in lendable:
            while count > 0 and num_blocks > 0:
                dst = max(free, key=lambda i: (free[i], -i), default=None)
                if dst is None or free[dst] <= 0:
                    return plan
                take = min(count, num_blocks, free[dst])
                plan.append((request_id, take, dst))
                free[dst] -= take
                count -= take
                num_blocks -= take
        return plan

    def _allocator(self, instance_id: int) -> BlockAllocator:
        if not 0 <= instance_id < len(self._allocators):
            raise ValueError(f"no instance {instance_id}: there are {len(self._allocators)}")
        return self._allocators[instance_id]


def _require_copy_id(copy_id: int) -> None:
    """A peer's copy must be named: a free or an audit naming copy 0 would match none, and the
    audit would count the live copy as no longer needed."""
    if type(copy_id) is not int or copy_id <= 0:
        raise ValueError(f"a peer's copy needs its positive id (its reservation's), got {copy_id!r}")


def _coalesce(table: list[Segment], is_local: Callable[[int], bool]) -> list[Segment]:
    """Merge consecutive segments on one instance of this process. A peer's segments stay apart:
    the peer holds each under its own id (the segment's first block)."""
    out: list[Segment] = []
    for segment in table:
        if (out and out[-1].instance_id == segment.instance_id and out[-1].token_end == segment.token_start
                and is_local(segment.instance_id)):
            prev = out[-1]
            out[-1] = Segment(prev.instance_id, prev.block_ids + segment.block_ids, prev.token_start,
                              prev.num_tokens + segment.num_tokens)
        else:
            out.append(segment)
    return out
