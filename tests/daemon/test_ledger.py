import pytest

from infinite_llm.daemon.ledger import CreditorLedger, EpochFence, HeldSegment, LedgerError


class FreeList:
    """A tiny allocator handing out the lowest free ids, as a pool's allocator would."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks))

    def allocate(self, n: int):
        if n > len(self.free_ids):
            return None
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return taken

    def free(self, ids) -> None:
        self.free_ids = sorted(self.free_ids + list(ids))


def make(num_blocks: int = 8, ttl: float = 10.0):
    pool = FreeList(num_blocks)
    return pool, CreditorLedger(pool.allocate, pool.free, reservation_ttl_s=ttl)


def test_reserve_commit_free_with_exact_block_ids() -> None:
    pool, ledger = make()
    first = ledger.reserve(home_inst_id=1, req_id=7, num_blocks=3, now=0.0)
    second = ledger.reserve(home_inst_id=2, req_id=9, num_blocks=2, now=0.0)
    assert first.block_ids == (0, 1, 2) and second.block_ids == (3, 4)
    assert ledger.num_blocks_reserved == 5 and pool.free_ids == [5, 6, 7]
    assert ledger.reserve(3, 1, 4, now=0.0) is None  # first come, first served: only 3 left

    segment = ledger.commit(first.reservation_id, 1, 7, segment_id=0, now=1.0)
    assert segment == HeldSegment(1, 7, 0, (0, 1, 2), first.reservation_id)
    assert ledger.num_blocks_held == 3 and ledger.num_blocks_reserved == 2
    assert ledger.free_segment(1, 7, 0) == 3
    assert ledger.free_segment(1, 7, 0) == 0  # a repeated free is harmless
    assert pool.free_ids == [0, 1, 2, 5, 6, 7]


def test_uncommitted_reservation_is_released_after_its_ttl() -> None:
    pool, ledger = make(ttl=5.0)
    r = ledger.reserve(1, 7, 4, now=100.0)
    assert ledger.release_expired(now=104.9) == []
    assert ledger.release_expired(now=105.0) == [r]
    assert pool.free_ids == list(range(8))
    with pytest.raises(LedgerError, match="expired or never made"):
        ledger.commit(r.reservation_id, 1, 7, 0, now=106.0)


def test_commit_must_match_the_reservation() -> None:
    _, ledger = make()
    r = ledger.reserve(1, 7, 2, now=0.0)
    with pytest.raises(LedgerError, match="is for request 7 of instance 1, not request 8"):
        ledger.commit(r.reservation_id, 1, 8, 0, now=0.0)
    ledger.commit(r.reservation_id, 1, 7, 0, now=0.0)
    r2 = ledger.reserve(1, 7, 1, now=0.0)
    with pytest.raises(LedgerError, match="already held"):
        ledger.commit(r2.reservation_id, 1, 7, 0, now=0.0)


def test_a_silent_debtor_loses_its_segments() -> None:
    pool, ledger = make()
    r1 = ledger.reserve(1, 7, 2, now=0.0)
    ledger.commit(r1.reservation_id, 1, 7, 0, now=0.0)
    r2 = ledger.reserve(2, 3, 2, now=0.0)
    ledger.commit(r2.reservation_id, 2, 3, 0, now=0.0)
    ledger.heard_from(2, now=25.0)
    assert ledger.free_lost_debtors(now=31.0, timeout_s=30.0) == {1: 2}
    assert ledger.segment(2, 3, 0).block_ids == (2, 3)
    with pytest.raises(LedgerError, match="no segment 0 of request 7 of instance 1"):
        ledger.segment(1, 7, 0)
    assert pool.free_ids == [0, 1, 4, 5, 6, 7]


def test_free_request_frees_segments_and_reservations() -> None:
    pool, ledger = make()
    r = ledger.reserve(1, 7, 2, now=0.0)
    ledger.commit(r.reservation_id, 1, 7, 0, now=0.0)
    ledger.reserve(1, 7, 3, now=0.0)
    ledger.reserve(1, 8, 1, now=0.0)
    assert ledger.free_request(1, 7) == 5
    assert pool.free_ids == [0, 1, 2, 3, 4, 6, 7]


def test_epoch_fence() -> None:
    fence = EpochFence()
    assert fence.admit(5) and fence.admit(5) and fence.admit(9)
    assert not fence.admit(5)
    assert fence.num_refused == 1 and fence.newest_epoch == 9


def test_a_reservation_receiving_data_outlives_the_receive() -> None:
    pool, ledger = make(ttl=10.0)
    r = ledger.reserve(1, 7, 3, now=0.0)
    # Data starts to arrive at 9 s; the transport bounds the receive to 10 s more.
    held = ledger.hold_while_receiving(r.reservation_id, until=19.0)
    assert held.expires_at == 29.0 and held.block_ids == r.block_ids
    assert ledger.release_expired(now=20.0) == []  # the old deadline would have freed blocks being written
    assert ledger.hold_while_receiving(r.reservation_id, until=1.0).expires_at == 29.0  # never shortened
    assert [x.reservation_id for x in ledger.release_expired(now=29.0)] == [r.reservation_id]
    assert pool.free_ids == list(range(8))
    with pytest.raises(LedgerError, match="no reservation"):
        ledger.hold_while_receiving(r.reservation_id, until=40.0)


def test_a_reservation_takes_its_data_once() -> None:
    """Data sent again for a reservation whose data landed (and whose commit has not come) is
    refused: every copy would put its expiry off once more, keeping the blocks from everyone
    for as long as the sender kept sending, never committed."""
    pool, ledger = make(ttl=10.0)
    r = ledger.reserve(1, 7, 3, now=0.0)
    ledger.hold_while_receiving(r.reservation_id, until=5.0)
    assert ledger.landed(r.reservation_id).filled
    with pytest.raises(LedgerError, match="landed already"):
        ledger.hold_while_receiving(r.reservation_id, until=14.0)
    assert ledger.reservations[r.reservation_id].expires_at == 15.0  # as the one receive left it
    assert [x.reservation_id for x in ledger.release_expired(now=15.0)] == [r.reservation_id]
    assert pool.free_ids == list(range(8))


def test_moves_travel_in_pieces_of_bounded_bytes() -> None:
    from infinite_llm.daemon.peers import MOVE_PIECE_BYTES, move_piece_blocks

    assert move_piece_blocks(2 << 20) == MOVE_PIECE_BYTES // (2 << 20) == 128  # Llama-3-8B bf16 blocks of 16 tokens
    assert move_piece_blocks(MOVE_PIECE_BYTES * 2) == 1  # a block larger than a piece still moves


def test_changes_to_a_homes_segments_are_counted_per_home() -> None:
    """What a creditor read from a home's segments stays true while the home's count stands:
    commits and frees of its segments count, reservations and other homes' segments do not."""
    _, ledger = make(num_blocks=8)
    first = ledger.reserve(1, 7, 2, now=0.0)
    assert ledger.held_changes.get(1, 0) == 0 and not ledger.has_segments_of(1)
    ledger.commit(first.reservation_id, 1, 7, segment_id=0, now=0.0)
    assert ledger.held_changes[1] == 1 and ledger.has_segments_of(1)
    other = ledger.reserve(2, 9, 2, now=0.0)
    ledger.commit(other.reservation_id, 2, 9, segment_id=0, now=0.0)
    assert ledger.held_changes[1] == 1 and ledger.held_changes[2] == 1
    ledger.free_segment(1, 7, 1)  # not held: nothing changes
    assert ledger.held_changes[1] == 1
    ledger.free_request(1, 7)
    assert ledger.held_changes[1] == 2 and not ledger.has_segments_of(1) and ledger.has_segments_of(2)


def test_holds_are_taken_first_come_all_or_nothing_and_used_up_by_the_requests_spills() -> None:
    pool, ledger = make(num_blocks=8)
    # Two homes ask for most of the same free blocks: the first gets them, the second nothing.
    assert ledger.set_hold(1, 7, 6, free_for_others=8, now=0.0) == 6
    assert ledger.set_hold(2, 9, 6, free_for_others=8 - ledger.num_blocks_on_hold, now=0.0) == 0
    assert ledger.num_blocks_on_hold == 6 and ledger.hold_of(2, 9) == 0
    # The first request's spill uses its hold up; the rest stays kept for it.
    ledger.reserve(1, 7, 4, now=0.0)
    assert ledger.hold_of(1, 7) == 2
    # Asking again sets the hold: more, while it fits; 0 releases it.
    assert ledger.set_hold(1, 7, 5, free_for_others=2, now=0.0) == 2  # 5 > 2 + 2: refused, kept
    assert ledger.set_hold(1, 7, 4, free_for_others=2, now=0.0) == 4
    assert ledger.set_hold(1, 7, 0, free_for_others=0, now=0.0) == 0 and ledger.num_blocks_on_hold == 0
    with pytest.raises(LedgerError):
        ledger.set_hold(1, 7, -1, free_for_others=8, now=0.0)


def test_a_renewed_hold_keeps_its_size_for_another_period_and_none_is_made() -> None:
    _, ledger = make()
    ledger.hold_ttl_s = 100.0
    assert ledger.set_hold(1, 7, 4, free_for_others=8, now=0.0) == 4
    ledger.reserve(1, 7, 3, now=50.0)  # a spill used three
    assert ledger.renew_hold(1, 7, now=90.0) == 1
    assert ledger.holds[(1, 7)].expires_at == 190.0 and ledger.last_heard[1] == 90.0
    ledger.release_expired(now=150.0)  # the spill's reservation, never committed
    assert ledger.hold_of(1, 7) == 1
    ledger.release_expired(now=190.0)
    assert ledger.renew_hold(1, 7, now=191.0) == 0 and ledger.holds == {}


def test_holds_end_with_their_request_their_home_or_their_time() -> None:
    _, ledger = make(num_blocks=16, ttl=10.0)
    ledger.hold_ttl_s = 100.0
    ledger.set_hold(1, 7, 2, free_for_others=16, now=0.0)
    ledger.set_hold(1, 8, 2, free_for_others=16, now=0.0)
    ledger.set_hold(2, 9, 2, free_for_others=16, now=50.0)
    ledger.free_request(1, 7)
    assert ledger.hold_of(1, 7) == 0 and ledger.hold_of(1, 8) == 2
    ledger.release_expired(now=120.0)  # 1/8 was asked at 0: past its time
    assert ledger.hold_of(1, 8) == 0 and ledger.hold_of(2, 9) == 2
    ledger.free_lost_debtors(now=200.0, timeout_s=30.0)
    assert ledger.holds == {}


def test_an_audit_frees_only_the_segments_it_named_as_they_were() -> None:
    pool, ledger = make()
    for req_id in (7, 8, 9):
        r = ledger.reserve(1, req_id, 2, now=0.0)
        ledger.commit(r.reservation_id, 1, req_id, segment_id=0, now=0.0)
    other = ledger.reserve(2, 5, 1, now=0.0)
    ledger.commit(other.reservation_id, 2, 5, segment_id=3, now=0.0)
    audited = ledger.held_for(1)
    assert [s.req_id for s in audited] == [7, 8, 9]
    # Meanwhile request 8's segment was freed and committed again under the same id (a newer
    # move of that request), and request 9's was freed: only request 7's is freed by the audit.
    ledger.free_segment(1, 8, 0)
    again = ledger.reserve(1, 8, 2, now=1.0)
    ledger.commit(again.reservation_id, 1, 8, segment_id=0, now=1.0)
    ledger.free_segment(1, 9, 0)
    assert ledger.free_audited(audited) == 2
    assert sorted(ledger.held) == [(1, 8, 0), (2, 5, 3)]
    assert ledger.held[(1, 8, 0)].block_ids == again.block_ids
    assert ledger.free_audited([]) == 0


def test_a_free_naming_another_copy_frees_nothing() -> None:
    pool, ledger = make()
    old = ledger.reserve(1, 7, 2, now=0.0)
    ledger.commit(old.reservation_id, 1, 7, segment_id=0, now=0.0)
    assert ledger.free_segment(1, 7, 0, old.reservation_id) == 2
    new = ledger.reserve(1, 7, 2, now=1.0)  # the same segment, moved here again
    ledger.commit(new.reservation_id, 1, 7, segment_id=0, now=1.0)
    assert new.reservation_id != old.reservation_id
    assert ledger.free_segment(1, 7, 0, old.reservation_id) == 0  # the old copy's free, come late
    assert ledger.segment(1, 7, 0).reservation_id == new.reservation_id
    assert ledger.free_segment(1, 7, 0, new.reservation_id) == 2


def test_reservation_ids_start_where_they_are_told() -> None:
    pool = FreeList(4)
    ledger = CreditorLedger(pool.allocate, pool.free, reservation_ttl_s=1.0, first_reservation_id=1 << 40)
    assert ledger.reserve(1, 7, 1, now=0.0).reservation_id == 1 << 40
    assert ledger.reserve(1, 8, 1, now=0.0).reservation_id == (1 << 40) + 1


def test_a_reservation_given_up_is_released_at_once_unless_data_is_landing_in_it() -> None:
    pool, ledger = make(num_blocks=6, ttl=10.0)
    idle = ledger.reserve(1, 7, 2, now=0.0)
    landing = ledger.reserve(1, 7, 2, now=0.0)
    ledger.hold_while_receiving(landing.reservation_id, until=30.0)
    # The home frees the copies by name before either was committed.
    assert ledger.free_segment(1, 7, 0, idle.reservation_id) == 2
    assert ledger.free_segment(1, 7, 2, landing.reservation_id) == 0
    assert ledger.free_segment(2, 7, 2, landing.reservation_id) == 0  # another home's free names nothing
    assert pool.free_ids == [0, 1, 4, 5]  # the landing blocks stay out
    with pytest.raises(LedgerError, match="given up"):
        ledger.commit(landing.reservation_id, 1, 7, segment_id=2, now=1.0)
    with pytest.raises(LedgerError, match="given up"):
        ledger.landed(landing.reservation_id)  # and released now that nothing writes there
    assert ledger.reservations == {} and pool.free_ids == [0, 1, 2, 3, 4, 5]


def test_a_forgotten_home_or_ended_request_keeps_landing_blocks_until_their_expiry() -> None:
    pool, ledger = make(num_blocks=4, ttl=10.0)
    landing = ledger.reserve(1, 7, 2, now=0.0)
    ledger.hold_while_receiving(landing.reservation_id, until=30.0)  # the frame timeout
    other = ledger.reserve(1, 8, 2, now=0.0)
    assert ledger.free_request(1, 8) == 2 and ledger.forget_home(1) == 0
    assert pool.free_ids == [2, 3]
    assert ledger.release_expired(now=39.0) == []  # the receive may go on until 30 s
    assert [r.reservation_id for r in ledger.release_expired(now=40.0)] == [landing.reservation_id]
    assert pool.free_ids == [0, 1, 2, 3] and other.reservation_id not in ledger.reservations


def test_landed_data_is_committed_as_before() -> None:
    _, ledger = make()
    reservation = ledger.reserve(1, 7, 2, now=0.0)
    ledger.hold_while_receiving(reservation.reservation_id, until=30.0)
    with pytest.raises(LedgerError, match="still landing"):
        ledger.commit(reservation.reservation_id, 1, 7, segment_id=4, now=1.0)
    assert not ledger.landed(reservation.reservation_id).receiving
    assert ledger.commit(reservation.reservation_id, 1, 7, segment_id=4, now=1.0).block_ids == (0, 1)


def test_a_request_of_another_run_of_a_home_frees_what_its_previous_run_left() -> None:
    pool, ledger = make()
    assert ledger.note_home_run(1, 0) is None and ledger.home_runs == {}  # a run not said: nothing known
    assert ledger.note_home_run(1, 11) is None  # the first run heard of
    reservation = ledger.reserve(1, 7, 3, now=0.0)
    ledger.commit(reservation.reservation_id, 1, 7, segment_id=0, now=0.0)
    ledger.reserve(1, 8, 2, now=0.0)
    ledger.set_hold(1, 9, 2, free_for_others=3, now=0.0)
    ledger.reserve(2, 5, 1, now=0.0)  # another home's: untouched
    assert ledger.note_home_run(1, 11) is None  # the same run again
    assert ledger.note_home_run(1, 12) == 5  # restarted: its segment and reservation go, and its hold
    assert ledger.held == {} and ledger.holds == {} and [r.home_inst_id for r in ledger.reservations.values()] == [2]
    assert ledger.home_runs == {1: 12} and pool.free_ids == [0, 1, 2, 3, 4, 6, 7]
    ledger.forget_home(1)
    assert ledger.home_runs == {}
