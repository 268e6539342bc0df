"""APB's hosts over the transport (``daemon/apb.py``): the inbox of passing blocks, and
``TransportHostGroup`` running ``engine.seq_parallel``'s prefills over the in-memory transport."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from infinite_llm.daemon.apb import APBAborted, APBInbox, TransportHostGroup
from infinite_llm.daemon.apb_plan import plan_apb
from infinite_llm.engine.seq_parallel import APBConfig, LocalHostGroup, apb_prefill, exact_prefill, ring_prefill
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.messages import Ack, APBPassing

from tiny_llama import CONFIG, tiny_model  # tests/tiny_llama.py (tests/ is on sys.path)

KEY = (7, 42)  # (home_inst_id, req_id)


def block(round_: int, src: int, value: float = 0.0, key: tuple[int, int] = KEY, shape=(2, 3)) -> APBPassing:
    return APBPassing(key[0], key[1], round_, src, torch.full(shape, value))


def run(coroutine):
    return asyncio.run(coroutine)


# --- APBInbox -------------------------------------------------------------------------------


def test_blocks_of_round_0_may_come_before_begin():
    async def main():
        inbox = APBInbox()
        assert isinstance(inbox.put(block(0, 1, 1.0), now=0.0), Ack)
        assert isinstance(inbox.put(block(0, 2, 2.0), now=0.0), Ack)
        assert inbox.num_early == 1  # one prefill's, two blocks
        inbox.begin(KEY, size=3, rank=0, num_rounds=4)
        assert inbox.num_early == 0
        parts = await inbox.take(KEY, 0, [2, 1], timeout_s=1.0)  # in the order asked
        assert [float(p[0, 0]) for p in parts] == [2.0, 1.0]
    run(main())


def test_early_blocks_a_prefill_cannot_take_are_dropped_at_begin():
    async def main():
        inbox = APBInbox()
        inbox.put(block(0, 1, 1.0), now=0.0)
        inbox.put(block(0, 0, 9.0), now=0.0)  # this host's own rank
        inbox.put(block(0, 5, 9.0), now=0.0)  # past the prefill's hosts
        inbox.begin(KEY, size=2, rank=0, num_rounds=3)
        (part,) = await inbox.take(KEY, 0, [1], timeout_s=1.0)
        assert float(part[0, 0]) == 1.0
        for src in (0, 5):
            with pytest.raises(APBAborted, match=rf"hosts \[{src}\] sent no passing block of round 0"):
                await inbox.take(KEY, 0, [src], timeout_s=0.05)
    run(main())


def test_a_later_round_before_begin_is_refused():
    inbox = APBInbox()
    with pytest.raises(ValueError, match="passing block of round 1 for request 42 of instance 7: no such APB prefill"):
        inbox.put(block(1, 1), now=0.0)
    assert inbox.num_early == 0


def test_early_prefills_are_capped():
    inbox = APBInbox(max_early=2)
    inbox.put(block(0, 1, key=(1, 1)), now=0.0)
    inbox.put(block(0, 1, key=(1, 2)), now=0.0)
    with pytest.raises(ValueError, match="no such APB prefill here, and 2 others wait to begin"):
        inbox.put(block(0, 1, key=(1, 3)), now=0.0)
    assert inbox.num_early == 2
    inbox.put(block(0, 2, key=(1, 1)), now=0.0)  # another block of a prefill kept already: fine
    assert inbox.num_early == 2
    inbox.begin((1, 1), size=3, rank=0, num_rounds=2)  # one fewer waiting: room for another
    assert inbox.num_early == 1
    inbox.put(block(0, 1, key=(1, 3)), now=0.0)
    assert inbox.num_early == 2


def test_early_blocks_are_dropped_after_their_ttl():
    async def main():
        inbox = APBInbox(max_early=1, early_ttl_s=10.0)
        inbox.put(block(0, 1, 1.0, key=(1, 1)), now=0.0)
        with pytest.raises(ValueError, match="1 others wait to begin"):
            inbox.put(block(0, 1, key=(1, 2)), now=10.0)  # not yet past the TTL
        inbox.put(block(0, 1, 2.0, key=(1, 2)), now=10.5)  # (1, 1)'s dropped: room again
        assert inbox.num_early == 1
        inbox.begin((1, 1), size=2, rank=0, num_rounds=2)
        with pytest.raises(APBAborted, match=r"hosts \[1\]"):  # its block was dropped
            await inbox.take((1, 1), 0, [1], timeout_s=0.05)
        inbox.begin((1, 2), size=2, rank=0, num_rounds=2)
        (part,) = await inbox.take((1, 2), 0, [1], timeout_s=1.0)
        assert float(part[0, 0]) == 2.0
    run(main())


def test_the_ttl_counts_from_a_prefills_first_early_block():
    inbox = APBInbox(max_early=1, early_ttl_s=10.0)
    inbox.put(block(0, 1, key=(1, 1)), now=0.0)
    inbox.put(block(0, 2, key=(1, 1)), now=9.0)  # a later block does not renew it
    inbox.put(block(0, 1, key=(1, 2)), now=10.5)
    assert inbox.num_early == 1


def test_duplicates_are_refused():
    inbox = APBInbox()
    inbox.put(block(0, 1), now=0.0)
    with pytest.raises(ValueError, match="round 0 of host 1 came twice"):
        inbox.put(block(0, 1), now=0.0)  # early
    inbox.begin(KEY, size=3, rank=0, num_rounds=3)
    with pytest.raises(ValueError, match="round 0 of host 1 came twice"):
        inbox.put(block(0, 1), now=0.0)  # the early one, now the prefill's
    inbox.put(block(1, 2), now=0.0)
    with pytest.raises(ValueError, match="round 1 of host 2 came twice"):
        inbox.put(block(1, 2), now=0.0)


@pytest.mark.parametrize("src", [3, 9, 0])  # 0: the inbox's own rank
def test_a_src_rank_the_prefill_has_not_is_refused(src):
    inbox = APBInbox()
    inbox.begin(KEY, size=3, rank=0, num_rounds=3)
    with pytest.raises(ValueError, match=rf"passing block from host {src}: the prefill of request 42 has hosts 0..2, "
                                         r"this is host 0"):
        inbox.put(block(1, src), now=0.0)


def test_a_round_past_the_prefills_is_refused():
    inbox = APBInbox()
    inbox.begin(KEY, size=2, rank=1, num_rounds=3)
    inbox.put(block(2, 0), now=0.0)
    with pytest.raises(ValueError, match="round 3: the prefill makes 3"):
        inbox.put(block(3, 0), now=0.0)


def test_begin_twice_is_refused_and_end_forgets_the_prefill():
    inbox = APBInbox()
    inbox.begin(KEY, size=2, rank=0, num_rounds=2)
    with pytest.raises(ValueError, match="APB prefill of request 42 of instance 7 is already under way"):
        inbox.begin(KEY, size=2, rank=0, num_rounds=2)
    inbox.end(KEY)
    with pytest.raises(ValueError, match="no such APB prefill here"):
        inbox.put(block(1, 1), now=0.0)  # a late block of the ended prefill
    inbox.end(KEY)  # again: nothing to do
    inbox.begin(KEY, size=2, rank=0, num_rounds=2)  # may begin anew


def test_fail_wakes_a_waiting_take():
    async def main():
        inbox = APBInbox()
        inbox.begin(KEY, size=3, rank=0, num_rounds=3)
        inbox.put(block(0, 1), now=0.0)
        waiting = asyncio.ensure_future(inbox.take(KEY, 0, [1, 2], timeout_s=30.0))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        started = time.monotonic()
        inbox.fail(KEY, "host 2 refused its chunk")
        with pytest.raises(APBAborted, match="^host 2 refused its chunk$"):
            await waiting
        assert time.monotonic() - started < 1.0
        # once failed, every later take fails at once, even for blocks that are there
        with pytest.raises(APBAborted, match="host 2 refused"):
            await inbox.take(KEY, 0, [1], timeout_s=30.0)
        inbox.fail((1, 1), "unknown prefill: nothing happens")
    run(main())


def test_take_waits_for_blocks_that_come_later():
    async def main():
        inbox = APBInbox()
        inbox.begin(KEY, size=3, rank=1, num_rounds=3)
        waiting = asyncio.ensure_future(inbox.take(KEY, 1, [0, 2], timeout_s=5.0))
        await asyncio.sleep(0.01)
        inbox.put(block(1, 2, 2.0), now=0.0)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        inbox.put(block(1, 0, 0.5), now=0.0)
        parts = await asyncio.wait_for(waiting, 1.0)
        assert [float(p[0, 0]) for p in parts] == [0.5, 2.0]
        # taken blocks leave the inbox: the same round again waits
        with pytest.raises(APBAborted):
            await inbox.take(KEY, 1, [0], timeout_s=0.05)
    run(main())


def test_take_times_out_naming_the_missing_hosts():
    async def main():
        inbox = APBInbox()
        inbox.begin(KEY, size=4, rank=0, num_rounds=3)
        inbox.put(block(2, 2), now=0.0)
        started = time.monotonic()
        with pytest.raises(APBAborted, match=r"^hosts \[1, 3\] sent no passing block of round 2 within 0\.2 s$"):
            await inbox.take(KEY, 2, [1, 2, 3], timeout_s=0.2)
        assert 0.15 <= time.monotonic() - started < 2.0
    run(main())


# --- TransportHostGroup over the in-memory transport ----------------------------------------



class Hosts:
    """H instances on one in-memory network, each with its transport and inbox."""

    def __init__(self, size: int, *, serving: int | None = None) -> None:
        self.network = InMemoryNetwork()
        self.transports = [self.network.transport() for _ in range(size)]
        self.inboxes = [APBInbox() for _ in range(size)]
        self.addresses = [t.address for t in self.transports]
        self.serving = size if serving is None else serving  # the first this many listen
        self.received: list[list[APBPassing]] = [[] for _ in range(size)]

    async def start(self) -> None:
        for rank, (transport, inbox) in enumerate(zip(self.transports[:self.serving], self.inboxes)):
            def handler(message, inbox=inbox, rank=rank):
                if isinstance(message, APBPassing):
                    self.received[rank].append(message)
                    return inbox.put(message, time.monotonic())
                raise ValueError(f"unexpected {type(message).__name__}")
            await transport.start(handler)

    def group(self, rank: int, key=KEY, timeout_s: float = 10.0) -> TransportHostGroup:
        return TransportHostGroup(self.transports[rank], self.inboxes[rank], key, rank, self.addresses,
                                  torch.device("cpu"), timeout_s)

    async def close(self) -> None:
        for transport in self.transports:
            await transport.close()


def assert_same_prefill(got, expected) -> None:
    assert got.positions.tolist() == expected.positions.tolist()
    torch.testing.assert_close(got.hidden, expected.hidden)
    assert len(got.kv) == len(expected.kv) == CONFIG.num_layers
    for (k, v), (k_ref, v_ref) in zip(got.kv, expected.kv):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)


def local_apb(model, doc, bounds, anchor_ids, query, config):
    async def main():
        groups = LocalHostGroup.create(len(bounds) - 1)
        return await asyncio.gather(*(apb_prefill(model, g, doc[bounds[g.rank]:bounds[g.rank + 1]], anchor_ids,
                                                  query, config) for g in groups))
    return asyncio.run(main())


@pytest.mark.parametrize("query_len, late_rank", [(5, None), (0, None), (5, 2), (0, 0)])
def test_apb_over_the_transport_equals_local_hosts(query_len, late_rank):
    # Compression on (passing_len below the chunk), so hosts 1 and 2 depend on the blocks
    # passed: the transport must carry them unchanged, in the right rounds and order.
    # late_rank: that host begins after the others have sent their round 0 (early blocks).
    model = tiny_model()
    size = 3
    generator = torch.Generator().manual_seed(11)
    doc = torch.randint(0, CONFIG.vocab_size, (52,), generator=generator)
    query = torch.randint(0, CONFIG.vocab_size, (query_len,), generator=generator)
    plan = plan_apb(52, size, 8, min_chunk_tokens=8, anchor_tokens=4, passing_tokens=6)
    assert plan.bounds == (0, 16, 32, 52)  # chunks of 16, 16, 20
    config = APBConfig(anchor_len=plan.anchor_len, passing_len=plan.passing_len)
    anchor_ids = doc[:plan.anchor_len]
    expected = local_apb(model, doc, plan.bounds, anchor_ids, query, config)
    # The later hosts' rows depend on the blocks passed to them (so a lost or misordered block shows).
    unpassed = local_apb(model, doc, plan.bounds, anchor_ids, query, APBConfig(plan.anchor_len, 0))
    assert all(not torch.allclose(expected[r].hidden, unpassed[r].hidden, atol=1e-3) for r in (1, 2))

    async def main():
        hosts = Hosts(size)
        await hosts.start()
        num_rounds = 1 + CONFIG.num_layers
        groups = [hosts.group(r) for r in range(size)]

        async def host(rank):
            if rank == late_rank:
                for _ in range(400):  # until the others' round-0 blocks wait for it
                    if hosts.inboxes[rank].num_early and len(hosts.received[rank]) == size - 1:
                        break
                    await asyncio.sleep(0.005)
                assert hosts.inboxes[rank].num_early == 1
            hosts.inboxes[rank].begin(KEY, size, rank, num_rounds)
            try:
                start, end = plan.chunk(rank)
                return await apb_prefill(model, groups[rank], doc[start:end], anchor_ids, query, config)
            finally:
                hosts.inboxes[rank].end(KEY)
        results = await asyncio.wait_for(asyncio.gather(*(host(r) for r in range(size))), 30)
        await hosts.close()
        return hosts, groups, results

    hosts, groups, results = asyncio.run(main())
    for got, want in zip(results, expected):
        assert_same_prefill(got, want)
    # every host heard each other host once per round: chunk lengths, then one block a layer
    for rank in range(size):
        heard = sorted((m.round, m.src_rank) for m in hosts.received[rank])
        assert heard == sorted((r, s) for r in range(1 + CONFIG.num_layers) for s in range(size) if s != rank)
        assert all(m.home_inst_id == KEY[0] and m.req_id == KEY[1] for m in hosts.received[rank])
    # bytes: an int64 chunk length, then [2, passing_len, kv_heads, head_dim] float32 a layer, to 2 peers each
    per_layer = 2 * plan.passing_len * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    for group in groups:
        assert group.bytes_sent == (8 + CONFIG.num_layers * per_layer) * (size - 1) > 0


def test_apb_over_the_transport_without_passing_sends_only_the_chunk_lengths():
    model = tiny_model()
    doc = torch.randint(0, CONFIG.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    config = APBConfig(anchor_len=4, passing_len=0)
    expected = local_apb(model, doc, (0, 16, 32), doc[:4], doc[:0], config)

    async def main():
        hosts = Hosts(2)
        await hosts.start()
        groups = [hosts.group(r) for r in range(2)]
        for r in range(2):
            hosts.inboxes[r].begin(KEY, 2, r, 1 + CONFIG.num_layers)
        results = await asyncio.gather(*(apb_prefill(model, g, doc[16 * g.rank:16 * (g.rank + 1)], doc[:4], doc[:0],
                                                     config) for g in groups))
        await hosts.close()
        return groups, results

    groups, results = asyncio.run(main())
    for got, want in zip(results, expected):
        assert_same_prefill(got, want)
    assert [g.bytes_sent for g in groups] == [8, 8]


def test_ring_prefill_over_the_transport_is_exact():
    model = tiny_model()
    size = 3
    prompt = torch.randint(0, CONFIG.vocab_size, (36,), generator=torch.Generator().manual_seed(5))
    exact = asyncio.run(exact_prefill(model, prompt))

    async def main():
        hosts = Hosts(size)
        await hosts.start()
        groups = [hosts.group(r) for r in range(size)]
        for r in range(size):
            hosts.inboxes[r].begin(KEY, size, r, (size - 1) * CONFIG.num_layers)
        results = await asyncio.wait_for(asyncio.gather(*(ring_prefill(model, g, prompt) for g in groups)), 30)
        await hosts.close()
        return groups, results

    groups, results = asyncio.run(main())
    assert sorted(torch.cat([h.positions for h in results]).tolist()) == list(range(36))
    for host in results:
        torch.testing.assert_close(host.hidden, exact.hidden[host.positions], atol=2e-4, rtol=2e-4)
        for (k, v), (k_ref, v_ref) in zip(host.kv, exact.kv):
            torch.testing.assert_close(k, k_ref[host.positions], atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(v, v_ref[host.positions], atol=2e-4, rtol=2e-4)
    # each pass sends [2, 2 * chunk, kv_heads, head_dim] float32 to one host
    per_pass = 2 * 12 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    assert all(g.bytes_sent == (size - 1) * CONFIG.num_layers * per_pass for g in groups)


def test_a_peer_that_never_sends_aborts_the_prefill_within_the_timeout():
    model = tiny_model()
    doc = torch.randint(0, CONFIG.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    config = APBConfig(anchor_len=4, passing_len=4)

    async def main():
        hosts = Hosts(2)  # host 1 listens (answers Ack) but never prefills
        await hosts.start()
        group = hosts.group(0, timeout_s=0.5)
        hosts.inboxes[0].begin(KEY, 2, 0, 1 + CONFIG.num_layers)
        started = time.monotonic()
        with pytest.raises(APBAborted, match=r"hosts \[1\] sent no passing block of round 0 within 0\.5 s"):
            await apb_prefill(model, group, doc[:16], doc[:4], doc[:0], config)
        elapsed = time.monotonic() - started
        assert hosts.inboxes[1].num_early == 1  # host 0's block reached it, to wait there
        assert group.bytes_sent == 8
        await hosts.close()
        return elapsed

    elapsed = asyncio.run(main())
    assert 0.4 <= elapsed < 3.0


def test_a_peer_with_no_listener_aborts_the_prefill_at_once():
    model = tiny_model()
    doc = torch.randint(0, CONFIG.vocab_size, (32,), generator=torch.Generator().manual_seed(3))

    async def main():
        hosts = Hosts(2, serving=1)  # nothing listens at host 1's address
        await hosts.start()
        group = hosts.group(0, timeout_s=5.0)
        hosts.inboxes[0].begin(KEY, 2, 0, 1 + CONFIG.num_layers)
        started = time.monotonic()
        with pytest.raises(APBAborted, match="passing block of round 0 to host 1"):
            await apb_prefill(model, group, doc[:16], doc[:4], doc[:0], APBConfig(4, 4))
        assert time.monotonic() - started < 2.0
        assert group.bytes_sent == 0
        await hosts.close()

    asyncio.run(main())


def test_a_block_of_another_shape_aborts_the_gather():
    async def main():
        hosts = Hosts(2)
        await hosts.start()
        group = hosts.group(0, timeout_s=1.0)
        hosts.inboxes[0].begin(KEY, 2, 0, 2)
        hosts.inboxes[0].put(APBPassing(*KEY, 0, 1, torch.zeros(2, dtype=torch.int64)), now=time.monotonic())
        with pytest.raises(APBAborted, match=r"host 1 sent a block of torch.int64 \[2\] in round 0, this host's is "
                                             r"torch.int64 \[1\]"):
            await group.all_gather(torch.tensor([5]))
        await hosts.close()

    asyncio.run(main())


def test_a_failed_peer_wakes_the_gather():
    async def main():
        hosts = Hosts(3)
        await hosts.start()
        group = hosts.group(0, timeout_s=30.0)
        hosts.inboxes[0].begin(KEY, 3, 0, 2)
        gather = asyncio.ensure_future(group.all_gather(torch.tensor([5])))
        await asyncio.sleep(0.02)
        assert not gather.done()
        hosts.inboxes[0].fail(KEY, "host 2 failed its chunk")
        with pytest.raises(APBAborted, match="host 2 failed its chunk"):
            await asyncio.wait_for(gather, 1.0)
        # its block went out before the wait: both peers hold it early
        assert [inbox.num_early for inbox in hosts.inboxes[1:]] == [1, 1]
        await hosts.close()

    asyncio.run(main())
