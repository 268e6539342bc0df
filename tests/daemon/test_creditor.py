import math
import random

import pytest
import torch

from infinite_llm.daemon.creditor import PLAN_ROOM_BLOCKS, AttendError, CreditorAttention
from infinite_llm.daemon.ledger import CreditorLedger
from infinite_llm.transport.messages import AttendRequest, AttendSlice

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 6, 2, 16, 4, 3


def make_creditor(num_blocks: int = 12):
    free = list(range(num_blocks))

    def allocate(n):
        nonlocal free
        if n > len(free):
            return None
        taken, free = free[:n], free[n:]
        return taken

    ledger = CreditorLedger(allocate, lambda ids: free.extend(ids), reservation_ttl_s=10)
    pool = torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return ledger, pool, CreditorAttention(ledger, pool, NUM_HEADS)


def hold(ledger, home, req, segment_id, num_blocks):
    r = ledger.reserve(home, req, num_blocks, now=0.0)
    return ledger.commit(r.reservation_id, home, req, segment_id, now=0.0)


def attention_over(pool, block_ids, num_tokens, layer, q):
    """float64 attention of q [rows, H, D] over the first num_tokens keys of the blocks."""
    k = pool[list(block_ids), layer, 0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:num_tokens].double()
    v = pool[list(block_ids), layer, 1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:num_tokens].double()
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("rhd,nhd->rhn", q.double(), k) / math.sqrt(HEAD_DIM)
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("rhn,nhd->rhd", torch.softmax(scores, -1), v), lse


def test_attend_over_two_requests_segments() -> None:
    ledger, pool, creditor = make_creditor()
    a = hold(ledger, home=1, req=7, segment_id=0, num_blocks=3)
    b = hold(ledger, home=1, req=9, segment_id=2, num_blocks=2)
    q = torch.randn(3, NUM_HEADS, HEAD_DIM)
    slices = (AttendSlice(7, 0, 1, 0, 10), AttendSlice(9, 1, 2, 2, 8))
    result = creditor.attend(AttendRequest(1, 5, step_id=4, layer=2, slices=slices, q=q))
    out_a, lse_a = attention_over(pool, a.block_ids, 10, 2, q[:1])
    out_b, lse_b = attention_over(pool, b.block_ids, 8, 2, q[1:])
    torch.testing.assert_close(result.out.double(), torch.cat([out_a, out_b]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse.double(), torch.cat([lse_a, lse_b]), rtol=1e-4, atol=1e-5)
    assert (result.step_id, result.layer, result.creditor_inst_id) == (4, 2, 5)


def test_unknown_segment_and_too_many_tokens_are_refused() -> None:
    ledger, _, creditor = make_creditor()
    hold(ledger, home=1, req=7, segment_id=0, num_blocks=2)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    with pytest.raises(AttendError, match="no segment 3 of request 7 of instance 1"):
        creditor.attend(AttendRequest(1, 5, 0, 0, (AttendSlice(7, 0, 1, 3, 4),), q))
    with pytest.raises(AttendError, match="9 tokens asked from segment 0 on, 8 held there"):
        creditor.attend(AttendRequest(1, 5, 0, 0, (AttendSlice(7, 0, 1, 0, 9),), q))
    with pytest.raises(AttendError, match="layer 3 outside"):
        creditor.attend(AttendRequest(1, 5, 0, 3, (AttendSlice(7, 0, 1, 0, 4),), q))


def test_a_slice_reads_across_consecutive_segments() -> None:
    """A long prompt spills a piece per chunk: the home asks for the tokens of consecutive
    segments in one slice, and the creditor reads them in order as one sequence."""
    ledger, pool, creditor = make_creditor()
    first = hold(ledger, home=1, req=7, segment_id=0, num_blocks=2)  # tokens 0..7
    second = hold(ledger, home=1, req=7, segment_id=2, num_blocks=3)  # tokens 8..19
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    result = creditor.attend(AttendRequest(1, 5, 0, 1, (AttendSlice(7, 0, 1, 0, 18),), q))
    out, lse = attention_over(pool, first.block_ids + second.block_ids, 18, 1, q)
    torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)
    # A gap (no segment starting at block 5) is refused, not read past.
    with pytest.raises(AttendError, match="21 tokens asked from segment 0 on, 20 held there"):
        creditor.attend(AttendRequest(1, 5, 1, 1, (AttendSlice(7, 0, 1, 0, 21),), q))


def test_queries_of_the_wrong_width_are_refused() -> None:
    ledger, _, creditor = make_creditor()
    hold(ledger, home=1, req=7, segment_id=0, num_blocks=2)
    q = torch.randn(1, NUM_HEADS - 1, HEAD_DIM)
    with pytest.raises(AttendError, match=f"this model has {NUM_HEADS} heads of dim {HEAD_DIM}"):
        creditor.attend(AttendRequest(1, 5, 0, 0, (AttendSlice(7, 0, 1, 0, 4),), q))


@pytest.mark.gpu
@pytest.mark.parametrize("host_staging_bytes", [0, 1 << 20])
def test_on_a_gpu_the_creditor_serves_beside_a_busy_default_stream(host_staging_bytes: int) -> None:
    """The attention runs on the creditor's own stream while the default stream is still busy
    with a long queue of work; small results come back in host memory, large ones on the
    device, both complete and equal to the float64 reference."""
    ledger, pool, _ = make_creditor(num_blocks=64)
    pool = pool.cuda()
    creditor = CreditorAttention(ledger, pool, NUM_HEADS, host_staging_bytes=host_staging_bytes)
    segment = hold(ledger, home=1, req=7, segment_id=0, num_blocks=40)
    q = torch.randn(4, NUM_HEADS, HEAD_DIM)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # some tens of milliseconds queued on the default stream
        busy = busy @ busy / 64
    result = creditor.attend(AttendRequest(1, 5, 0, 1, (AttendSlice(7, 0, 4, 0, 150),), q))
    assert result.out.is_cuda == (host_staging_bytes == 0)
    out, lse = attention_over(pool.cpu(), segment.block_ids, 150, 1, q)
    torch.testing.assert_close(result.out.cpu().double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse.cpu().double(), lse, rtol=1e-4, atol=1e-5)
    torch.cuda.synchronize()


def test_the_plan_is_kept_across_steps_and_follows_a_changed_segment() -> None:
    """A decode step asks for the same slices at every layer and step: the plan is kept. A
    segment freed and committed again (other blocks, other keys) is read from its new blocks,
    through the same plan: its tables are rewritten."""
    ledger, pool, creditor = make_creditor(num_blocks=16)
    first = hold(ledger, home=1, req=7, segment_id=0, num_blocks=3)
    slices = (AttendSlice(7, 0, 1, 0, 11),)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    creditor.attend(AttendRequest(1, 5, step_id=0, layer=0, slices=slices, q=q))
    kept = creditor._plans[1]
    result = creditor.attend(AttendRequest(1, 5, step_id=1, layer=2, slices=slices, q=q))
    assert creditor._plans[1] is kept and creditor.plan_retargets == 0
    out, lse = attention_over(pool, first.block_ids, 11, 2, q)
    torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)

    hold(ledger, home=1, req=8, segment_id=0, num_blocks=2)  # so that the next commit gets other blocks
    ledger.free_segment(1, 7, 0)
    again = hold(ledger, home=1, req=7, segment_id=0, num_blocks=3)
    assert set(again.block_ids) != set(first.block_ids)
    result = creditor.attend(AttendRequest(1, 5, step_id=2, layer=2, slices=slices, q=q))
    assert creditor._plans[1] is kept and creditor.plan_retargets == 1
    assert kept.segments == (again,)
    out, lse = attention_over(pool, again.block_ids, 11, 2, q)
    torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)


def test_segments_are_looked_up_again_only_after_one_of_the_homes_segments_is_freed() -> None:
    """Every layer of every step names the same slices: while the ledger has changed nothing of
    the home's, the kept plan is used without walking its segments again; a segment added (of
    another request) changes none of the row's, and only one freed means a walk again."""
    ledger, pool, creditor = make_creditor(num_blocks=16)
    held = [hold(ledger, home=1, req=7, segment_id=2 * i, num_blocks=2) for i in range(3)]
    slices = (AttendSlice(7, 0, 1, 0, 24),)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    creditor.attend(AttendRequest(1, 5, 0, 0, slices, q))
    lookups = []
    segment = ledger.segment
    ledger.segment = lambda *key: lookups.append(key) or segment(*key)
    for step in range(1, 4):
        creditor.attend(AttendRequest(1, 5, step, 1, slices, q))
    hold(ledger, home=2, req=7, segment_id=0, num_blocks=2)  # another home's: nothing to look up
    creditor.attend(AttendRequest(1, 5, 4, 1, slices, q))
    assert lookups == []
    hold(ledger, home=1, req=9, segment_id=0, num_blocks=2)
    creditor.attend(AttendRequest(1, 5, 5, 1, slices, q))
    assert lookups == []
    ledger.free_segment(1, 9, 0)
    result = creditor.attend(AttendRequest(1, 5, 6, 1, slices, q))
    assert lookups == [(1, 7, 0), (1, 7, 2), (1, 7, 4)]
    out, lse = attention_over(pool, [b for h in held for b in h.block_ids], 24, 1, q)
    torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)


def test_kv_moved_in_while_decoding_keeps_the_plan_until_it_outgrows_its_room() -> None:
    """Blocks moved here after the held ones make the slice longer, over one more segment: the
    kept plan serves it while the keys fit its room; past that a new plan does; a slice of other
    rows is a new plan too. Every answer equals the reference over the blocks named."""
    ledger, pool, creditor = make_creditor(num_blocks=48)
    held = [hold(ledger, home=1, req=7, segment_id=0, num_blocks=4)]
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)

    def attend_over_held(step: int, rows: int = 1):
        num_tokens = sum(len(s.block_ids) for s in held) * BLOCK_SIZE - 1
        q_rows = q.expand(rows, -1, -1).contiguous()
        result = creditor.attend(AttendRequest(1, 5, step, 1, (AttendSlice(7, 0, rows, 0, num_tokens),), q_rows))
        blocks = [b for s in held for b in s.block_ids]
        out, lse = attention_over(pool, blocks, num_tokens, 1, q_rows)
        torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)

    attend_over_held(0)
    kept = creditor._plans[1]
    assert kept.max_tokens == (4 + PLAN_ROOM_BLOCKS) * BLOCK_SIZE
    for step in range(1, 9):  # two blocks moved in a step: 20 blocks are the plan's room
        held.append(hold(ledger, home=1, req=7, segment_id=sum(len(s.block_ids) for s in held), num_blocks=2))
        attend_over_held(step)
        assert creditor._plans[1] is kept
    assert creditor.plan_retargets == 8
    held.append(hold(ledger, home=1, req=7, segment_id=20, num_blocks=2))
    attend_over_held(9)
    assert creditor._plans[1] is not kept
    kept = creditor._plans[1]
    attend_over_held(10, rows=2)
    assert creditor._plans[1] is not kept and creditor.plan_retargets == 8


def test_a_kept_plan_follows_segments_added_and_freed_in_any_order() -> None:
    """Two requests of one home decode over segments held here while segments are added after
    theirs (moves), freed (the home took KV back, or a request restarted) and committed again
    on other blocks, at random: every answer equals attention over the blocks the ledger names,
    whether the plan was extended by the segments that came, retargeted, or made again."""
    rng = random.Random(7)
    ledger, pool, creditor = make_creditor(num_blocks=96)
    held = {7: [hold(ledger, 1, 7, 0, 3)], 8: [hold(ledger, 1, 8, 0, 2)]}
    q = torch.randn(2, NUM_HEADS, HEAD_DIM)
    for step in range(60):
        action = rng.random()
        req = rng.choice((7, 8))
        segments = held[req]
        end = segments[-1].segment_id + len(segments[-1].block_ids)
        if action < 0.5:
            segments.append(hold(ledger, 1, req, end, rng.randint(1, 2)))
        elif action < 0.65 and len(segments) > 1:
            last = segments.pop()  # KV taken back from the end
            ledger.free_segment(1, req, last.segment_id)
        elif action < 0.75:
            index = rng.randrange(len(segments))  # one segment freed and committed again elsewhere
            old = segments[index]
            ledger.free_segment(1, req, old.segment_id)
            segments[index] = hold(ledger, 1, req, old.segment_id, len(old.block_ids))
        num_tokens = {r: sum(len(s.block_ids) for s in held[r]) * BLOCK_SIZE - rng.randrange(BLOCK_SIZE)
                      for r in (7, 8)}
        slices = (AttendSlice(7, 0, 1, 0, num_tokens[7]), AttendSlice(8, 1, 1, 0, num_tokens[8]))
        result = creditor.attend(AttendRequest(1, 5, step, step % NUM_LAYERS, slices, q))
        for row, r in enumerate((7, 8)):
            blocks = [b for s in held[r] for b in s.block_ids]
            out, lse = attention_over(pool, blocks, num_tokens[r], step % NUM_LAYERS, q[row:row + 1])
            torch.testing.assert_close(result.out[row:row + 1].double(), out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(result.lse[row:row + 1].double(), lse, rtol=1e-4, atol=1e-5)
    assert creditor.plan_retargets > 10  # most steps were served by the kept plan


@pytest.mark.gpu
def test_on_a_gpu_decode_rows_are_served_from_a_graph_per_layer() -> None:
    """Each layer of a plan runs eagerly once, then from its graph: the same figures as the
    float64 reference at every step, a new query each time; a changed segment drops the graphs
    and is read from its new blocks."""
    ledger, pool, _ = make_creditor(num_blocks=96)
    pool = pool.cuda()
    creditor = CreditorAttention(ledger, pool, NUM_HEADS, host_staging_bytes=1 << 16)
    first = hold(ledger, home=1, req=7, segment_id=0, num_blocks=30)
    second = hold(ledger, home=1, req=7, segment_id=30, num_blocks=20)
    blocks = first.block_ids + second.block_ids
    slices = (AttendSlice(7, 0, 2, 0, 190),)
    for step in range(3):
        for layer in range(NUM_LAYERS):
            q = torch.randn(2, NUM_HEADS, HEAD_DIM)
            result = creditor.attend(AttendRequest(1, 5, step, layer, slices, q))
            assert not result.out.is_cuda
            out, lse = attention_over(pool.cpu(), blocks, 190, layer, q)
            torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)
    assert creditor.graph_captures == NUM_LAYERS
    assert creditor.graph_replays == 2 * NUM_LAYERS
    assert creditor.num_graphs == NUM_LAYERS

    # KV moved: the second segment now lies in other blocks, and more blocks came after it. The
    # graphs serve the new slice, their tables rewritten; a slice past the plan's room is a new
    # plan, without graphs until each layer has run eagerly.
    ledger.free_segment(1, 7, 30)
    moved = hold(ledger, home=1, req=7, segment_id=30, num_blocks=20)
    more = hold(ledger, home=1, req=7, segment_id=50, num_blocks=6)
    blocks = first.block_ids + moved.block_ids + more.block_ids
    grown = (AttendSlice(7, 0, 2, 0, 222),)
    for layer in range(NUM_LAYERS):
        q = torch.randn(2, NUM_HEADS, HEAD_DIM)
        result = creditor.attend(AttendRequest(1, 5, 3, layer, grown, q))
        out, lse = attention_over(pool.cpu(), blocks, 222, layer, q)
        torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)
    assert (creditor.graph_captures, creditor.graph_replays, creditor.plan_retargets) == (NUM_LAYERS, 3 * NUM_LAYERS, 1)
    past_room = hold(ledger, home=1, req=7, segment_id=56, num_blocks=20)
    result = creditor.attend(AttendRequest(1, 5, 4, 1, (AttendSlice(7, 0, 2, 0, 300),), q))
    assert creditor.num_graphs == 0
    out, lse = attention_over(pool.cpu(), blocks + past_room.block_ids, 300, 1, q)
    torch.testing.assert_close(result.out.double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse.double(), lse, rtol=1e-4, atol=1e-5)

    eager = CreditorAttention(ledger, pool, NUM_HEADS, host_staging_bytes=1 << 16, cuda_graphs=False)
    for step in range(3):
        eager.attend(AttendRequest(1, 5, step, 0, slices, q))
    assert eager.graph_replays == 0 and eager.num_graphs == 0
