"""APB's cut of a document over hosts (``daemon/apb_plan.py``): pure logic."""

from __future__ import annotations

import itertools

import pytest

from infinite_llm.daemon.apb_plan import (
    DEFAULT_ANCHOR_FRACTION,
    DEFAULT_ANCHOR_MIN_TOKENS,
    DEFAULT_PASSING_FRACTION,
    DEFAULT_PASSING_MIN_TOKENS,
    APBPlan,
    PrefillOptions,
    plan_apb,
)


def check_plan(plan: APBPlan, doc_len: int, num_hosts: int, block_size: int) -> None:
    """What every plan must hold: H chunks covering the document, block-aligned, in order."""
    assert isinstance(plan, APBPlan)
    assert plan.num_hosts == num_hosts
    assert len(plan.bounds) == num_hosts + 1
    assert plan.bounds[0] == 0 and plan.bounds[-1] == doc_len == plan.doc_len
    assert all(b > a for a, b in zip(plan.bounds, plan.bounds[1:])), plan.bounds
    assert all(b % block_size == 0 for b in plan.bounds[1:-1]), plan.bounds
    # the chunks tile the document, each rank's after the one before
    assert [plan.chunk(r) for r in range(num_hosts)] == list(zip(plan.bounds, plan.bounds[1:]))
    assert sum(plan.chunk_len(r) for r in range(num_hosts)) == doc_len
    assert 0 <= plan.anchor_len <= plan.chunk_len(0)
    assert plan.passing_len >= 0


# --- plans ----------------------------------------------------------------------------------


@pytest.mark.parametrize("doc_len, num_hosts, block_size, bounds", [
    (64, 2, 16, (0, 32, 64)),
    (100, 2, 16, (0, 48, 100)),  # 50 rounded down to the block
    (300, 3, 16, (0, 96, 192, 300)),
    (4096, 4, 16, (0, 1024, 2048, 3072, 4096)),
    (1000, 3, 1, (0, 333, 666, 1000)),
    (130, 2, 64, (0, 64, 130)),
])
def test_bounds(doc_len, num_hosts, block_size, bounds):
    plan = plan_apb(doc_len, num_hosts, block_size, min_chunk_tokens=1)
    check_plan(plan, doc_len, num_hosts, block_size)
    assert plan.bounds == bounds


def test_the_home_takes_the_last_chunk_which_ends_at_the_documents_end():
    plan = plan_apb(1000, 4, 16, min_chunk_tokens=16)
    assert plan.chunk(3) == (plan.bounds[3], 1000)
    assert plan.chunk(0)[0] == 0
    assert plan.chunk_len(3) >= plan.chunk_len(0)  # rounding down leaves the rest to the last chunk


@pytest.mark.parametrize("doc_len, num_hosts, block_size", [(64, 2, 16), (1000, 3, 16), (4096, 8, 16),
                                                            (999, 5, 7), (257, 4, 1)])
def test_default_anchor_and_passing(doc_len, num_hosts, block_size):
    plan = plan_apb(doc_len, num_hosts, block_size, min_chunk_tokens=1)
    chunk = doc_len // num_hosts
    assert plan.anchor_len == min(max(int(chunk * DEFAULT_ANCHOR_FRACTION), DEFAULT_ANCHOR_MIN_TOKENS),
                                  plan.chunk_len(0))
    assert plan.passing_len == max(int(chunk * DEFAULT_PASSING_FRACTION), DEFAULT_PASSING_MIN_TOKENS)


def test_default_fractions_are_a_quarter_and_an_eighth_above_their_floors():
    assert DEFAULT_ANCHOR_FRACTION == 0.25
    assert DEFAULT_PASSING_FRACTION == 0.125
    assert (DEFAULT_ANCHOR_MIN_TOKENS, DEFAULT_PASSING_MIN_TOKENS) == (1024, 512)
    plan = plan_apb(65536, 4, 16, min_chunk_tokens=256)  # chunks of 16K: the fractions
    assert (plan.anchor_len, plan.passing_len) == (4096, 2048)
    plan = plan_apb(4096, 4, 16, min_chunk_tokens=256)  # chunks of 1K: the floors, the anchor cut to chunk 0
    assert (plan.anchor_len, plan.passing_len) == (1024, 512)
    plan = plan_apb(2048, 4, 16, min_chunk_tokens=256)
    assert (plan.anchor_len, plan.passing_len) == (512, 512)


def test_default_passing_is_at_least_its_floor():
    plan = plan_apb(8, 2, 1, min_chunk_tokens=1)  # chunk of 4: an eighth is 0
    assert plan.passing_len == DEFAULT_PASSING_MIN_TOKENS
    assert plan.anchor_len == 4  # the floor, cut to chunk 0


def test_anchor_is_capped_at_chunk_0():
    # Host 0's chunk is the even cut rounded down to a block: 95 -> 64 here.
    plan = plan_apb(190, 2, 64, min_chunk_tokens=64)
    assert plan.bounds == (0, 64, 190)
    assert plan.anchor_len == 64  # the default's floor, cut to chunk 0
    plan = plan_apb(190, 2, 64, min_chunk_tokens=64, anchor_tokens=100)
    assert plan.anchor_len == 64  # an explicit one longer than chunk 0 is cut to it
    plan = plan_apb(190, 2, 64, min_chunk_tokens=64, anchor_tokens=64)
    assert plan.anchor_len == 64


def test_a_quarter_chunk_anchor_never_needs_the_cap():
    # Chunk 0 is at least one block and more than chunk - block: a quarter of a chunk fits.
    for doc_len, num_hosts, block_size in itertools.product(range(2, 600, 3), range(2, 6), (1, 4, 16, 64)):
        plan = plan_apb(doc_len, num_hosts, block_size, min_chunk_tokens=1)
        if isinstance(plan, APBPlan):
            assert int(doc_len // num_hosts * DEFAULT_ANCHOR_FRACTION) <= plan.chunk_len(0)


@pytest.mark.parametrize("anchor, passing", [(0, 0), (7, 3), (32, 32), (1, 500)])
def test_explicit_anchor_and_passing(anchor, passing):
    plan = plan_apb(128, 2, 16, min_chunk_tokens=16, anchor_tokens=anchor, passing_tokens=passing)
    check_plan(plan, 128, 2, 16)
    assert plan.anchor_len == anchor  # all at most chunk 0 (64)
    assert plan.passing_len == passing  # not capped: the engine takes min(passing, chunk)


def test_passing_zero_is_allowed_and_kept():
    plan = plan_apb(4096, 4, 16, min_chunk_tokens=16, passing_tokens=0)
    assert plan.passing_len == 0
    assert plan.anchor_len == 1024  # the default still (its floor: chunks of 1K)
    plan = plan_apb(4096, 4, 16, min_chunk_tokens=16, anchor_tokens=0)
    assert plan.anchor_len == 0 and plan.passing_len == 512


def test_many_shapes_hold_the_invariants():
    block_sizes = (1, 3, 8, 16, 64)
    count = 0
    for doc_len, num_hosts, block_size in itertools.product(range(1, 700, 7), range(1, 9), block_sizes):
        min_chunk = max(block_size, 1)
        plan = plan_apb(doc_len, num_hosts, block_size, min_chunk_tokens=min_chunk)
        if num_hosts == 1:
            assert isinstance(plan, str) and "one host" in plan
            continue
        if doc_len < num_hosts * block_size:
            assert isinstance(plan, str) and "too few" in plan, (doc_len, num_hosts, block_size)
            continue
        check_plan(plan, doc_len, num_hosts, block_size)
        # min_chunk_tokens is the block here: every chunk is at least one block
        assert all(plan.chunk_len(r) >= block_size for r in range(num_hosts))
        # the cut is the even cut rounded down to the block: never off by a block or more
        for r in range(1, num_hosts):
            even = r * doc_len // num_hosts
            assert even - block_size < plan.bounds[r] <= even
        count += 1
    assert count > 1000  # the loop did test plans, not only fallbacks


def test_every_chunk_is_at_least_min_chunk_tokens_when_it_is_a_multiple_of_the_block():
    for doc_len, num_hosts, (block_size, min_chunk) in itertools.product(
            range(100, 3000, 37), range(2, 7), [(16, 256), (16, 32), (8, 8), (4, 100)]):
        plan = plan_apb(doc_len, num_hosts, block_size, min_chunk_tokens=min_chunk)
        if isinstance(plan, str):
            assert doc_len < num_hosts * min_chunk
            continue
        assert doc_len >= num_hosts * min_chunk
        check_plan(plan, doc_len, num_hosts, block_size)
        assert min(plan.chunk_len(r) for r in range(num_hosts)) >= min_chunk, (doc_len, num_hosts, plan.bounds)


def test_no_chunk_is_shorter_than_min_chunk_tokens():
    # min_chunk_tokens 100 with blocks of 16 asks for chunks of 112 (cuts are rounded down to blocks):
    # 300 tokens cannot give three of them, 400 can.
    assert isinstance(plan_apb(300, 3, 16, min_chunk_tokens=100), str)
    plan = plan_apb(400, 3, 16, min_chunk_tokens=100)
    assert isinstance(plan, APBPlan)
    assert min(plan.chunk_len(r) for r in range(3)) >= 100
    for doc_len in range(300, 2000, 7):
        for min_chunk in (17, 50, 100, 250):
            plan = plan_apb(doc_len, 3, 16, min_chunk_tokens=min_chunk)
            if isinstance(plan, APBPlan):
                assert min(plan.chunk_len(r) for r in range(3)) >= min_chunk, (doc_len, min_chunk, plan.bounds)


# --- fallbacks and refusals -----------------------------------------------------------------


def test_one_host_falls_back():
    why = plan_apb(10_000, 1, 16, min_chunk_tokens=16)
    assert why == "one host: an APB prefill over one instance is an exact prefill"


@pytest.mark.parametrize("doc_len, num_hosts, block_size, min_chunk, expected_min", [
    (767, 3, 16, 256, 256),  # one token short of 3 chunks of 256
    (0, 2, 16, 1, 16),
    (31, 2, 16, 1, 16),  # min_chunk_tokens below the block: the block is the minimum
    (31, 2, 16, 8, 16),
    (63, 2, 16, 32, 32),
])
def test_too_short_falls_back(doc_len, num_hosts, block_size, min_chunk, expected_min):
    why = plan_apb(doc_len, num_hosts, block_size, min_chunk_tokens=min_chunk)
    assert isinstance(why, str)
    assert why == (f"the document has {doc_len} tokens, too few for {num_hosts} chunks of at least "
                   f"{expected_min} tokens (apb_min_chunk_tokens)")


def test_just_long_enough_makes_a_plan():
    plan = plan_apb(768, 3, 16, min_chunk_tokens=256)
    check_plan(plan, 768, 3, 16)
    assert plan.bounds == (0, 256, 512, 768)
    plan = plan_apb(32, 2, 16, min_chunk_tokens=1)  # min_chunk below the block: two blocks suffice
    assert plan.bounds == (0, 16, 32)


@pytest.mark.parametrize("num_hosts, block_size, min_chunk", [(0, 16, 16), (-1, 16, 16), (2, 0, 16),
                                                              (2, -16, 16), (2, 16, 0), (2, 16, -1)])
def test_non_positive_arguments_raise(num_hosts, block_size, min_chunk):
    with pytest.raises(ValueError, match="must be positive"):
        plan_apb(1024, num_hosts, block_size, min_chunk_tokens=min_chunk)


def test_plan_accessors():
    plan = APBPlan((0, 16, 48, 50), anchor_len=4, passing_len=2)
    assert plan.num_hosts == 3 and plan.doc_len == 50
    assert plan.chunk(1) == (16, 48) and plan.chunk_len(1) == 32 and plan.chunk_len(2) == 2


# --- PrefillOptions -------------------------------------------------------------------------


def test_prefill_options_defaults():
    options = PrefillOptions()
    assert (options.mode, options.query, options.hosts, options.anchor_tokens, options.passing_tokens,
            options.scorer) == ("exact", None, None, None, None, "attention")
    assert not options.apb
    assert PrefillOptions(mode="apb").apb


def test_prefill_options_accepts_good_values():
    options = PrefillOptions("apb", (1, 2, 0), hosts=1, anchor_tokens=0, passing_tokens=0, scorer="random")
    assert options.apb and options.query == (1, 2, 0) and options.passing_tokens == 0
    assert PrefillOptions(query="what?").query == "what?"
    assert PrefillOptions(query=()).query == ()


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, r"prefill must be one of exact, apb, got 'fast'"),
    ({"mode": "APB"}, r"prefill must be one of"),
    ({"mode": None}, r"prefill must be one of"),
    ({"scorer": "best"}, r"apb_scorer must be one of attention, random, got 'best'"),
    ({"hosts": 0}, r"apb_hosts must be an integer >= 1, got 0"),
    ({"hosts": -2}, r"apb_hosts must be an integer >= 1"),
    ({"hosts": True}, r"apb_hosts must be an integer >= 1, got True"),
    ({"hosts": 2.0}, r"apb_hosts must be an integer >= 1"),
    ({"anchor_tokens": -1}, r"apb_anchor_tokens must be an integer >= 0, got -1"),
    ({"anchor_tokens": False}, r"apb_anchor_tokens must be an integer >= 0, got False"),
    ({"anchor_tokens": "8"}, r"apb_anchor_tokens must be an integer >= 0"),
    ({"passing_tokens": -1}, r"apb_passing_tokens must be an integer >= 0, got -1"),
    ({"passing_tokens": True}, r"apb_passing_tokens must be an integer >= 0"),
    ({"query": [1, 2]}, r"query must be a string or a list of token ids"),  # a list, not a tuple
    ({"query": (1, -2)}, r"query must be a string or a list of token ids"),
    ({"query": (1, True)}, r"query must be a string or a list of token ids"),
    ({"query": (1, 2.0)}, r"query must be a string or a list of token ids"),
    ({"query": 5}, r"query must be a string or a list of token ids"),
    ({"query": b"bytes"}, r"query must be a string or a list of token ids"),
])
def test_prefill_options_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefillOptions(**kwargs)


def test_prefill_options_is_frozen():
    options = PrefillOptions(mode="apb")
    with pytest.raises(AttributeError):
        options.mode = "exact"  # type: ignore[misc]
