"""The fast search for the best k gives the same plan as scanning every k."""

from hypothesis import HealthCheck, event, given, settings, strategies as st, target

from infinite_llm.scheduler.perf_model import PerfModel
from infinite_llm.scheduler.policy import (
    ClusterSnapshot,
    InstanceState,
    PlacementTable,
    RequestPlacementEntry,
    Thresholds,
    plan,
)


@st.composite
def models(draw):
    knee = draw(st.none() | st.integers(1, 12))
    token_knee = draw(st.none() | st.integers(16, 4000))
    return PerfModel(
        num_layers=draw(st.integers(1, 40)),
        dense_fixed_s=draw(st.floats(1e-5, 1e-3)),
        dense_per_seq_s=draw(st.floats(0, 1e-4)),
        attn_s_per_token=draw(st.floats(1e-9, 1e-6)),
        dense_knee_batch=knee,
        dense_per_seq_above_knee_s=draw(st.floats(0, 1e-4)) if knee else 0.0,
        attn_knee_tokens=token_knee,
        attn_s_per_token_above_knee=draw(st.floats(0, 1e-6)) if token_knee else 0.0,
        remote_overhead_s=draw(st.floats(0, 1e-4)),
    )


@st.composite
def snapshots(draw):
    num_instances = draw(st.integers(2, 6))
    instances, entries, req_id = [], [], 0
    for inst in range(num_instances):
        total = draw(st.integers(4, 300))
        used = 0
        for _ in range(draw(st.integers(0, 5))):
            blocks = draw(st.integers(1, 120))
            if used + blocks > total:
                break
            entries.append(RequestPlacementEntry(req_id, inst, blocks, True))
            used += blocks
            # Sometimes part of the request already lives elsewhere.
            if draw(st.booleans()) and inst > 0:
                entries.append(RequestPlacementEntry(req_id, draw(st.integers(0, inst - 1)), 0, False))
            req_id += 1
        free = total - used - draw(st.integers(0, total - used))  # some blocks reserved, not placed
        waiting = draw(st.integers(0, 6))
        instances.append(InstanceState(inst, total, free, waiting, waiting * draw(st.integers(1, 20))))
    # Remote parts drawn above hold 0 blocks; give some of them blocks that fit the creditor.
    free = {i.inst_id: i.total_blocks - i.free_blocks for i in instances}
    used = {i.inst_id: 0 for i in instances}
    for e in entries:
        used[e.inst_id] += e.num_blocks
    final = []
    for e in entries:
        if not e.local:
            room = free[e.inst_id] - used[e.inst_id]
            blocks = draw(st.integers(0, max(0, min(room, 40))))
            used[e.inst_id] += blocks
            e = RequestPlacementEntry(e.req_id, e.inst_id, blocks, False)
        final.append(e)
    return ClusterSnapshot(draw(st.sampled_from([1, 16])), tuple(instances), PlacementTable.from_entries(final))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots(), models(), st.integers(1, 8), st.floats(0.2, 1.0), st.none() | st.integers(1, 3))
def test_breakpoint_search_plans_like_the_exhaustive_scan(snap, model, debtor_batch, creditor_use, per_debtor):
    thresholds = Thresholds(debtor_batch, creditor_use, max_moves=12, creditors_per_debtor=per_debtor)
    fast = plan(snap, model, thresholds)
    reference = plan(snap, model, thresholds, search="scan")
    # Steer the search towards snapshots with many moves, where the two could part.
    target(float(len(reference)))
    event(f"moves: {min(len(reference), 3)}{'+' if len(reference) >= 3 else ''}")
    assert [(m.req_id, m.src_inst, m.dst_inst, m.num_blocks) for m in fast] == [
        (m.req_id, m.src_inst, m.dst_inst, m.num_blocks) for m in reference
    ]
    assert [m.predicted_gain for m in fast] == [m.predicted_gain for m in reference]
