"""What one instance holds for others, and the leader epochs it has seen: pure bookkeeping.

The creditor side of a KV move: ``reserve`` takes free blocks first-come-first-served (or
refuses), ``commit`` turns a reservation into a held segment, ``release_expired`` frees
reservations whose commit never came, ``free_segment`` and ``free_lost_debtors`` give blocks
back (a reservation whose data is still landing only once it has landed: ``cancel``),
``held_for`` and ``free_audited`` let a home's audit free what it no longer counts on.
Time is passed in (seconds on any monotonic clock), so tests drive it by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable


class LedgerError(ValueError):
    """A reservation or segment that does not exist or does not match."""


@dataclass(frozen=True)
class Reservation:
    reservation_id: int
    home_inst_id: int  # the request's home
    req_id: int
    block_ids: tuple[int, ...]  # blocks in this pool, in the order the moved blocks fill them
    expires_at: float  # clock seconds
    # Data is being written into the blocks (``hold_while_receiving``) until ``landed``: the blocks
    # may not go to anyone else before then, whatever happens to the request.
    receiving: bool = False
    # Its home gave it up (a free naming it, the request's end, the home gone) while it was
    # receiving: never committed, released once the data has landed or at its expiry.
    cancelled: bool = False
    # Its data has landed: it waits for its commit and takes no data again. A home that sent
    # the blocks again and again would otherwise put its expiry off with every copy, keeping
    # the blocks from everyone without ever committing them.
    filled: bool = False


@dataclass(frozen=True)
class Hold:
    """Blocks of this pool kept for one request of another instance: free, but counted on."""

    num_blocks: int
    expires_at: float  # clock seconds; a hold not used up by then is released


@dataclass(frozen=True)
class HeldSegment:
    """A run of another instance's request, held in this pool."""

    home_inst_id: int
    req_id: int
    segment_id: int  # the home's id for this segment
    block_ids: tuple[int, ...]
    reservation_id: int = 0  # the reservation it was committed from: this copy's id


@dataclass
class CreditorLedger:
    """Reservations and held segments of one pool.

    ``allocate(n) -> list[int] | None`` and ``free(block_ids)`` are the pool's allocator (the
    engine's block allocator in the daemon): the ledger decides, the allocator hands out ids.
    """

    allocate: Callable[[int], list[int] | None]
    free: Callable[[Iterable[int]], None]
    reservation_ttl_s: float  # an uncommitted reservation lives this long
    reservations: dict[int, Reservation] = field(default_factory=dict)
    held: dict[tuple[int, int, int], HeldSegment] = field(default_factory=dict)  # (home, req, segment)
    last_heard: dict[int, float] = field(default_factory=dict)  # home -> clock seconds
    # home -> how many times its held segments changed (a commit, a free): what was read from
    # them stays true while this stays the same.
    held_changes: dict[int, int] = field(default_factory=dict)
    # home -> how many of its held segments were freed: while this stays the same, every
    # segment read before is still held (only new ones came), whatever ``held_changes`` says.
    held_removals: dict[int, int] = field(default_factory=dict)
    # (home, req) -> blocks kept for the request's spills: a home asks before such a request
    # starts, so that two homes never both count on the same free blocks.
    holds: dict[tuple[int, int], Hold] = field(default_factory=dict)
    # home -> the run (its membership record's run_id) whose requests made what is held here
    # for it: a request of another run means the home restarted (``note_home_run``).
    home_runs: dict[int, int] = field(default_factory=dict)
    hold_ttl_s: float = 300.0
    # Reservation ids name copies in frees that may come late: a daemon starts them at a random
    # point, so that no id of its previous run names a copy of this one.
    first_reservation_id: int = 1
    _next_reservation_id: int = field(init=False)

    def __post_init__(self) -> None:
        self._next_reservation_id = self.first_reservation_id

    @property
    def num_blocks_on_hold(self) -> int:
        return sum(h.num_blocks for h in self.holds.values())

    def hold_of(self, home_inst_id: int, req_id: int) -> int:
        hold = self.holds.get((home_inst_id, req_id))
        return 0 if hold is None else hold.num_blocks

    def set_hold(self, home_inst_id: int, req_id: int, num_blocks: int, free_for_others: int, now: float) -> int:
        """Keep ``num_blocks`` for the request, all or nothing: granted while they fit
        ``free_for_others`` (this pool's free blocks for others, every hold taken off) plus what
        the request holds already; 0 releases. Returns the blocks held for it now."""
        if num_blocks < 0:
            raise LedgerError(f"num_blocks must not be negative, got {num_blocks}")
        key = (home_inst_id, req_id)
        current = self.hold_of(home_inst_id, req_id)
        if num_blocks == 0:
            self.holds.pop(key, None)
            return 0
        if num_blocks > free_for_others + current:
            return current
        self.holds[key] = Hold(num_blocks, now + self.hold_ttl_s)
        self.last_heard[home_inst_id] = now
        return num_blocks

    def renew_hold(self, home_inst_id: int, req_id: int, now: float) -> int:
        """Keep the request's hold, as it is, for ``hold_ttl_s`` from ``now``; the blocks held
        (0: none is kept, and none is made)."""
        key = (home_inst_id, req_id)
        hold = self.holds.get(key)
        if hold is None:
            return 0
        self.holds[key] = Hold(hold.num_blocks, now + self.hold_ttl_s)
        self.last_heard[home_inst_id] = now
        return hold.num_blocks

    @property
    def num_blocks_reserved(self) -> int:
        return sum(len(r.block_ids) for r in self.reservations.values())

    @property
    def num_blocks_held(self) -> int:
        """Blocks of this pool holding other instances' requests (committed)."""
        return sum(len(s.block_ids) for s in self.held.values())

    def reserve(self, home_inst_id: int, req_id: int, num_blocks: int, now: float) -> Reservation | None:
        """Reserve ``num_blocks`` free blocks, or None when the pool has fewer free."""
        if num_blocks <= 0:
            raise LedgerError(f"num_blocks must be positive, got {num_blocks}")
        block_ids = self.allocate(num_blocks)
        if block_ids is None:
            return None
        hold = self.holds.get((home_inst_id, req_id))
        if hold is not None:  # the request's spill uses up what was kept for it
            if hold.num_blocks <= num_blocks:
                del self.holds[(home_inst_id, req_id)]
            else:
                self.holds[(home_inst_id, req_id)] = Hold(hold.num_blocks - num_blocks, hold.expires_at)
        reservation = Reservation(self._next_reservation_id, home_inst_id, req_id, tuple(block_ids),
                                  now + self.reservation_ttl_s)
        self._next_reservation_id += 1
        self.reservations[reservation.reservation_id] = reservation
        self.last_heard[home_inst_id] = now
        return reservation

    def reservation(self, reservation_id: int) -> Reservation:
        try:
            return self.reservations[reservation_id]
        except KeyError:
            raise LedgerError(f"no reservation {reservation_id} (expired or never made)") from None

    def commit(self, reservation_id: int, home_inst_id: int, req_id: int, segment_id: int, now: float) -> HeldSegment:
        """The home switched its block table: the reserved blocks become a held segment."""
        reservation = self.reservation(reservation_id)
        if reservation.cancelled:
            raise LedgerError(f"reservation {reservation_id} was given up by instance {reservation.home_inst_id}")
        if reservation.receiving:  # a held segment's blocks may be freed at once: not while written
            raise LedgerError(f"data for reservation {reservation_id} is still landing")
        if (reservation.home_inst_id, reservation.req_id) != (home_inst_id, req_id):
            raise LedgerError(
                f"reservation {reservation_id} is for request {reservation.req_id} of instance "
                f"{reservation.home_inst_id}, not request {req_id} of instance {home_inst_id}"
            )
        key = (home_inst_id, req_id, segment_id)
        if key in self.held:
            raise LedgerError(f"segment {segment_id} of request {req_id} of instance {home_inst_id} is already held")
        del self.reservations[reservation_id]
        segment = HeldSegment(home_inst_id, req_id, segment_id, reservation.block_ids, reservation_id)
        self.held[key] = segment
        self.held_changes[home_inst_id] = self.held_changes.get(home_inst_id, 0) + 1
        self.last_heard[home_inst_id] = now
        return segment

    def segment(self, home_inst_id: int, req_id: int, segment_id: int) -> HeldSegment:
        try:
            return self.held[(home_inst_id, req_id, segment_id)]
        except KeyError:
            raise LedgerError(f"no segment {segment_id} of request {req_id} of instance {home_inst_id} here") from None

    def has_segments_of(self, home_inst_id: int) -> bool:
        """Whether any segment of the home's requests is held here."""
        return any(key[0] == home_inst_id for key in self.held)

    def held_for(self, home_inst_id: int) -> list[HeldSegment]:
        """The segments held here for one home's requests."""
        return [s for key, s in self.held.items() if key[0] == home_inst_id]

    def free_audited(self, audited: Iterable[HeldSegment]) -> int:
        """Free the segments a home's audit found stale, each only if it is still the one
        audited: a segment freed and committed again under the same id since the audit was
        sent (a new move of that request) is the new move's. Returns the blocks freed."""
        freed = 0
        for segment in audited:
            key = (segment.home_inst_id, segment.req_id, segment.segment_id)
            if self.held.get(key) is segment:
                freed += self.free_segment(*key)
        return freed

    def free_segment(self, home_inst_id: int, req_id: int, segment_id: int, reservation_id: int | None = None) -> int:
        """Free one held segment; returns the blocks freed (0 if it was not held: frees repeat).
        ``reservation_id``: only the copy committed from that reservation (a late free leaves a
        newer copy under the same id alone); None: whichever is held. A copy not committed yet
        (its home gave up a move whose data is still landing here) is cancelled: never
        committed, its blocks free once no data is written into them."""
        key = (home_inst_id, req_id, segment_id)
        segment = self.held.get(key)
        if segment is None or (reservation_id is not None and segment.reservation_id != reservation_id):
            reservation = self.reservations.get(reservation_id) if reservation_id is not None else None
            if reservation is not None and (reservation.home_inst_id, reservation.req_id) == (home_inst_id, req_id):
                return self.cancel(reservation_id)
            return 0
        del self.held[key]
        self.held_changes[home_inst_id] = self.held_changes.get(home_inst_id, 0) + 1
        self.held_removals[home_inst_id] = self.held_removals.get(home_inst_id, 0) + 1
        self.free(segment.block_ids)
        return len(segment.block_ids)

    def free_request(self, home_inst_id: int, req_id: int) -> int:
        """Free every segment and reservation of one request (finished or cancelled)."""
        freed = 0
        for key in [k for k in self.held if k[:2] == (home_inst_id, req_id)]:
            freed += self.free_segment(*key)
        for rid in [r.reservation_id for r in self.reservations.values() if (r.home_inst_id, r.req_id) == (home_inst_id, req_id)]:
            freed += self.cancel(rid)
        self.holds.pop((home_inst_id, req_id), None)
        return freed

    def heard_from(self, home_inst_id: int, now: float) -> None:
        self.last_heard[home_inst_id] = now

    def hold_while_receiving(self, reservation_id: int, until: float) -> Reservation:
        """Data for the reservation has started to arrive: it must not expire (and its blocks go
        to someone else while they are being written) before ``until``, the latest the receive
        can end, plus the usual time for the commit."""
        reservation = self.reservation(reservation_id)
        if reservation.cancelled:
            raise LedgerError(f"reservation {reservation_id} was given up by instance {reservation.home_inst_id}")
        if reservation.filled:
            raise LedgerError(f"the data of reservation {reservation_id} has landed already: it is committed "
                              "or expires, and takes no data again")
        expires_at = max(reservation.expires_at, until + self.reservation_ttl_s)
        reservation = dataclasses.replace(reservation, expires_at=expires_at, receiving=True)
        self.reservations[reservation_id] = reservation
        return reservation

    def landed(self, reservation_id: int) -> Reservation:
        """The data of ``hold_while_receiving`` is all written: the blocks are this pool's to
        give again if the reservation ends. Raises LedgerError, and releases it, if its home gave
        it up meanwhile; LedgerError too if no data was placed in it."""
        reservation = self.reservation(reservation_id)
        if reservation.cancelled:
            self._release(reservation_id)
            raise LedgerError(f"reservation {reservation_id} was given up by instance {reservation.home_inst_id} "
                              "while its data landed")
        if not reservation.receiving:
            raise LedgerError(f"blocks for reservation {reservation_id} came without being placed in it")
        reservation = dataclasses.replace(reservation, receiving=False, filled=True)
        self.reservations[reservation_id] = reservation
        return reservation

    def cancel(self, reservation_id: int) -> int:
        """Give a reservation up: released now, or, while data is written into its blocks, never
        committed and released once it landed (or at its expiry, which the receive extended).
        Returns the blocks freed now."""
        reservation = self.reservations.get(reservation_id)
        if reservation is None:
            return 0
        if not reservation.receiving:
            return self._release(reservation_id)
        self.reservations[reservation_id] = dataclasses.replace(reservation, cancelled=True)
        return 0

    def release_expired(self, now: float) -> list[Reservation]:
        """Release reservations whose commit did not come in time; returns them."""
        expired = [r for r in self.reservations.values() if r.expires_at <= now]
        for r in expired:
            self._release(r.reservation_id)
        for key in [k for k, h in self.holds.items() if h.expires_at <= now]:
            del self.holds[key]
        return expired

    def free_lost_debtors(self, now: float, timeout_s: float) -> dict[int, int]:
        """Free everything held for homes silent longer than ``timeout_s``: {home: blocks freed}."""
        lost = [home for home, t in self.last_heard.items() if now - t > timeout_s]
        return {home: self.forget_home(home) for home in lost}

    def note_home_run(self, home_inst_id: int, run_id: int) -> int | None:
        """A home's request names its run (``run_id``; 0: not said). Where this ledger holds
        what another run of that home asked for, that run is gone (restarted) and its segments,
        reservations and holds are freed first: returns the blocks freed then, else None."""
        if run_id <= 0:
            return None
        before = self.home_runs.get(home_inst_id)
        freed = self.forget_home(home_inst_id) if before is not None and before != run_id else None
        self.home_runs[home_inst_id] = run_id
        return freed

    def forget_home(self, home_inst_id: int) -> int:
        """Free every segment, reservation and hold of one home (gone, or restarted: a new run
        knows nothing of them); returns the blocks freed."""
        self.home_runs.pop(home_inst_id, None)
        count = 0
        for key in [k for k in self.held if k[0] == home_inst_id]:
            count += self.free_segment(*key)
        for rid in [r.reservation_id for r in self.reservations.values() if r.home_inst_id == home_inst_id]:
            count += self.cancel(rid)
        for key in [k for k in self.holds if k[0] == home_inst_id]:
            del self.holds[key]
        self.last_heard.pop(home_inst_id, None)
        return count

    def _release(self, reservation_id: int) -> int:
        reservation = self.reservations.pop(reservation_id)
        self.free(reservation.block_ids)
        return len(reservation.block_ids)


@dataclass
class EpochFence:
    """Refuses commands from deposed leaders: an epoch older than the newest seen is stale."""

    newest_epoch: int = 0
    num_refused: int = 0

    def admit(self, epoch: int) -> bool:
        """True (and remember the epoch) unless ``epoch`` is older than the newest seen."""
        if epoch < self.newest_epoch:
            self.num_refused += 1
            return False
        self.newest_epoch = epoch
        return True

    def refuse_late(self) -> None:
        """Count a command admitted earlier and dropped now: a newer leader spoke while it
        waited (for a step boundary, or between the pieces of a move)."""
        self.num_refused += 1
