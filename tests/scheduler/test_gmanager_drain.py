"""The gManager's drain without processes: heartbeats fed by hand, a fake clock, and a transport
that records every command and answers it. The whole trace of commands is asserted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from infinite_llm.scheduler.drain import DrainRefused, UnknownInstance
from infinite_llm.scheduler.gmanager import MovesUnsettled, NotLeader
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.messages import Ack, ErrorCode, MoveKV
from gmanager_testlib import PORT_BASE, Cluster, RecordingTransport, heartbeat, until


def test_drain_refusals_plan_moves_and_safe_to_stop(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    # Instance 1 runs request 7: 24 blocks at home, 12 on instance 2, 9 on 3. Instance 2 runs
    # request 5 with 10 blocks at home. Instance 3 has only 5 free blocks at first.
    c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 2, 12), (7, 3, 9)), borrowed=21)
    c.beat(2, 30, 1, upserts=((5, 2, 10),), lent=12)
    c.beat(3, 5, 0, lent=9)

    async def scenario() -> None:
        with pytest.raises(UnknownInstance, match="unknown instance 9"):
            await gm.drain(9, dry_run=False)
        # Request 7's 12 blocks may go only to 3 (1 is their home), which has 5 free: refused.
        with pytest.raises(DrainRefused, match="request 7 of instance 1 has 12 blocks on instance 2"):
            await gm.drain(2, dry_run=False)
        assert c.transport.sent == [] and gm.drain_status(2)["draining"] is False

        c.now = 1.0
        c.beat(3, 50, 0, lent=9)
        plan = await gm.drain(2, dry_run=True)
        assert [(m["home_inst_id"], m["req_id"], m["src_inst_id"], m["dst_inst_id"], m["num_blocks"], m["kind"])
                for m in plan["moves"]] == [(1, 7, 2, 3, 12, "held"), (2, 5, 2, 1, 9, "own")]
        assert c.transport.sent == []

        report = await gm.drain(2, dry_run=False)
        assert report["draining"] and report["state"] == "draining" and not report["safe_to_stop"]
        await until(lambda: len(gm.drain_status(2)["moves"]) == 2)
        # Cordon first; then each move goes to the request's home, which carries it out.
        assert c.transport.commands() == [(2, "drain", 2), (1, "move", 1, 7, 2, 3, 12), (2, "move", 2, 5, 2, 1, 9)]
        assert {m.epoch for _, m in c.transport.sent} == {4}
        assert [m["result"] for m in gm.drain_status(2)["moves"]] == ["committed", "committed"]
        # While it drains, instance 2 is no creditor: not in hints, not in the policy's room.
        assert all(i["draining"] == (i["instance_id"] == 2) for i in gm.status()["instances"])
        hints = gm.view.creditor_hints(c.now, 1, 3)
        assert 2 in {h.inst_id for h in hints}  # the view alone would name it
        c.now = 1.5
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 3, 21)), borrowed=21)
        reply = await gm.handle(heartbeat(3, 100, 64, 38, 0, 0, 1, lent=21))
        assert 2 not in {h.inst_id for h in reply.creditors}

        # Newer heartbeats: the segment moved; request 5 still runs on 2 with one block at home.
        c.now = 2.0
        c.beat(1, 31, 1, upserts=((7, 1, 24), (7, 3, 21)), borrowed=21, lent=9)
        c.beat(2, 63, 1, upserts=((5, 2, 1), (5, 1, 9)), borrowed=9)
        await until(lambda: gm.drain_status(2)["rounds"] >= 1)
        status = gm.drain_status(2)
        assert (status["running_requests"], status["blocks_held_for_others"], status["safe_to_stop"]) == (1, 0, False)
        assert len(c.transport.sent) == 3  # nothing more to move: one block stays where it is written

        # Request 5 finished: nothing runs on 2 and nothing is held there.
        c.now = 3.0
        c.beat(2, 64, 0)
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 3, 21)), borrowed=21)
        await until(lambda: gm.drain_status(2)["safe_to_stop"])
        assert gm.drain_status(2)["state"] == "safe_to_stop"

        assert await gm.uncordon(2) == {"instance_id": 2, "draining": False}
        assert c.transport.commands()[-1] == (2, "uncordon", 2)
        assert gm.drain_status(2)["draining"] is False
        with pytest.raises(UnknownInstance):
            await gm.uncordon(9)

    asyncio.run(scenario())


def test_the_policy_places_nothing_on_a_draining_instance(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    c.one_debtor_two_empty()

    async def scenario() -> None:
        before = {m["dst_inst_id"] for m in (await gm.rebalance(dry_run=True))["moves"]}
        assert before, "the imbalance should make the policy move blocks"
        await gm.drain(3, dry_run=False)
        after = {m["dst_inst_id"] for m in (await gm.rebalance(dry_run=True))["moves"]}
        assert after and 3 not in after
        gm._drains[3].task.cancel()

    asyncio.run(scenario())


def test_a_drain_s_moves_hold_off_the_round_until_heartbeats_show_them(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    c.beat(1, 64, 0)
    c.beat(2, 4, 1, upserts=((5, 2, 60),))  # request 5 on a nearly full instance 2
    c.beat(3, 64, 0)

    async def scenario() -> None:
        c.now = 1.0
        await gm.drain(2, dry_run=False)
        await until(lambda: len(gm.drain_status(2)["moves"]) == 1)
        assert c.transport.commands() == [(2, "drain", 2), (2, "move", 2, 5, 2, 1, 59)]
        # The figures still show 60 blocks of request 5 on instance 2: no round from them.
        c.now = 1.1
        assert not gm.moves_settled()
        with pytest.raises(MovesUnsettled, match=r"instance\(s\) 1, 2"):
            await gm.rebalance(dry_run=False)
        c.now = 1.5
        c.beat(1, 5, 0, lent=59)
        c.beat(2, 63, 1, upserts=((5, 2, 1), (5, 1, 59)), borrowed=59)
        assert gm.moves_settled()
        assert (await gm.rebalance(dry_run=False))["moves"] == []
        assert len(c.transport.sent) == 2
        gm._drains[2].task.cancel()

    asyncio.run(scenario())


def test_a_deposed_leader_neither_drains_nor_uncordons(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 2, 12)), borrowed=12)
    c.beat(2, 30, 1, upserts=((5, 2, 10),), lent=12)
    c.beat(3, 50, 0)

    async def scenario() -> None:
        # The lease is lost; the loop that steps down has not noticed yet.
        c.election.leading = False
        with pytest.raises(NotLeader):
            await gm.drain(2, dry_run=False)
        with pytest.raises(NotLeader):
            await gm.uncordon(2)
        assert c.transport.sent == []

    asyncio.run(scenario())


def test_a_leader_deposed_during_a_drain_sends_no_more_of_its_moves(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    # Instance 2 runs requests 5 and 6: two moves, both sent by their home 2, one after the other.
    c.beat(1, 64, 0)
    c.beat(2, 24, 2, upserts=((5, 2, 20), (6, 2, 20)))
    c.beat(3, 64, 0)

    class LosesLeadershipOnFirstMove(RecordingTransport):
        async def request(self, peer, message, timeout_s=None):
            if isinstance(message, MoveKV):
                c.election.leading = False  # lost while this move waited for its commit
            return await super().request(peer, message, timeout_s)

    gm.transport = c.transport = LosesLeadershipOnFirstMove()

    async def scenario() -> None:
        await gm.drain(2, dry_run=False)
        await until(lambda: len(gm.drain_status(2)["moves"]) == 2)
        assert c.transport.commands() == [(2, "drain", 2), (2, "move", 2, 5, 2, 1, 19)]
        assert [m["result"] for m in gm.drain_status(2)["moves"]] == ["committed", "not_leader"]

    asyncio.run(scenario())


def test_a_drained_instance_that_restarts_and_runs_requests_is_not_safe_to_stop(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    c.beat(1, 64, 0)
    c.beat(2, 64, 0)
    c.beat(3, 64, 0)

    async def scenario() -> None:
        await gm.drain(2, dry_run=False)

        def heartbeats_until(condition: Callable[[], bool], free: int, batch: int, upserts=()) -> Callable[[], bool]:
            """Heartbeats of all three, a little later each time, until ``condition()``."""
            def beat_and_check() -> bool:
                c.now += 0.1
                c.beat(1, 64, 0)
                c.beat(2, free, batch, upserts)
                c.beat(3, 64, 0)
                return condition()
            return beat_and_check

        await until(heartbeats_until(lambda: gm.drain_status(2)["safe_to_stop"], 64, 0))
        # Instance 2 restarts (never forgotten: within --silent-after-heartbeats), is not
        # cordoned any more, and runs two requests.
        c.now += 1.0
        c.restart(2)
        c.beat(2, 40, 2, upserts=((1, 2, 12), (2, 2, 12)))
        status = gm.drain_status(2)
        assert (status["state"], status["safe_to_stop"], status["running_requests"]) == ("draining", False, 2)
        # Draining it again cordons it again and moves its requests' blocks once it reports.
        status = await gm.drain(2, dry_run=False)
        assert (status["state"], status["safe_to_stop"]) == ("draining", False)
        assert c.transport.commands() == [(2, "drain", 2), (2, "drain", 2)]
        await until(heartbeats_until(lambda: len(c.transport.sent) == 4, 40, 2, ((1, 2, 12), (2, 2, 12))))
        assert c.transport.commands()[2:] == [(2, "move", 2, 1, 2, 1, 11), (2, "move", 2, 2, 2, 3, 11)]
        gm._drains[2].task.cancel()

    asyncio.run(scenario())


def total_sent(status: dict) -> int:
    """Moves a drain has sent over all its rounds, from its report's counters."""
    return sum(sum(results.values()) for results in status["move_results"].values())


async def drain_until_lost(c: Cluster) -> None:
    """Instance 2 is drained; after the first round it is silent a little longer than
    --silent-after-heartbeats (20 s here) while the others go on: the drain is lost."""
    gm = c.gm
    c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 2, 12)), borrowed=12)
    c.beat(2, 30, 1, upserts=((5, 2, 10),), lent=12)
    c.beat(3, 50, 0)
    await gm.drain(2, dry_run=False)
    await until(lambda: len(gm.drain_status(2)["moves"]) == 2)
    c.now = 20.5
    c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 3, 12)), borrowed=12)
    c.beat(3, 38, 0, lent=12)
    await until(lambda: gm.drain_status(2)["state"] == "lost")
    assert gm._drains[2].task.done()


def beat_all_drained(c: Cluster) -> Callable[[], bool]:
    """Heartbeats of all three, a little later each time, instance 2 empty; true once safe to stop."""
    def beat_and_check() -> bool:
        c.now += 0.1
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 3, 12)), borrowed=12)
        c.beat(2, 64, 0)
        c.beat(3, 38, 0, lent=12)
        return c.gm.drain_status(2)["safe_to_stop"]
    return beat_and_check


FIRST_ROUND = [(2, "drain", 2), (1, "move", 1, 7, 2, 3, 12), (2, "move", 2, 5, 2, 1, 9)]


def test_a_lost_drain_resumes_when_its_instance_heartbeats_again(tmp_path) -> None:
    """A stall, not a stop: instance 2 heartbeats again before it is forgotten. The periodic
    loop's drain step cordons it again and the drain goes on to safe to stop."""
    c = Cluster(tmp_path)
    gm = c.gm

    async def scenario() -> None:
        await drain_until_lost(c)
        gm._resume_returned_drains()  # still silent: nothing to resume
        assert gm._drains[2].task.done() and c.transport.commands() == FIRST_ROUND

        c.now = 21.0
        c.beat(2, 54, 1, upserts=((5, 2, 1), (5, 1, 9)), borrowed=9)
        await gm._forget_silent()
        assert gm.drain_status(2)["state"] == "lost"
        gm._resume_returned_drains()
        await until(lambda: gm.drain_status(2)["state"] == "draining")
        assert c.transport.commands() == [*FIRST_ROUND, (2, "drain", 2)]
        await until(beat_all_drained(c))
        status = gm.drain_status(2)
        assert (status["state"], status["running_requests"], status["blocks_held_for_others"]) == ("safe_to_stop", 0, 0)
        assert gm._drains[2].task.done()

    asyncio.run(scenario())


def test_a_drain_request_restarts_a_lost_drain_once_its_instance_is_back(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm

    async def scenario() -> None:
        await drain_until_lost(c)
        # Still silent: the request reports the drain and sends nothing.
        assert (await gm.drain(2, dry_run=False))["state"] == "lost"
        assert c.transport.commands() == FIRST_ROUND

        c.now = 21.0
        c.beat(2, 54, 1, upserts=((5, 2, 1), (5, 1, 9)), borrowed=9)
        status = await gm.drain(2, dry_run=False)
        assert (status["state"], status["drain_id"]) == ("draining", 1)
        assert c.transport.commands() == [*FIRST_ROUND, (2, "drain", 2)]
        await until(beat_all_drained(c))
        assert gm.drain_status(2)["state"] == "safe_to_stop"

    asyncio.run(scenario())


class SlowTransport(RecordingTransport):
    """Answers each command after a round trip, so that requests to the gManager overlap."""

    async def request(self, peer, message, timeout_s=None):
        self.sent.append((peer.port - PORT_BASE, message))
        await asyncio.sleep(0.05)
        return Ack()


def test_two_drain_requests_at_once_run_one_drain_and_uncordon_stops_it(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    gm.transport = c.transport = SlowTransport()

    def beat_all() -> None:
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 2, 12)), borrowed=12)
        c.beat(2, 30, 1, upserts=((5, 2, 10),), lent=12)
        c.beat(3, 50, 0)

    def drain_loops() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "drain-2" and not t.done()]

    async def scenario() -> None:
        beat_all()
        # infctl drain and the instance's own stop-time request, say, at the same moment.
        first, second = await asyncio.gather(gm.drain(2, dry_run=False), gm.drain(2, dry_run=False))
        assert first["drain_id"] == second["drain_id"] == 1
        assert "planned_moves" in first and "planned_moves" not in second  # the second is a report
        await until(lambda: len(gm.drain_status(2)["moves"]) == 2)
        assert c.transport.commands() == FIRST_ROUND
        loops = drain_loops()
        assert len(loops) == 1
        await gm.uncordon(2)
        await asyncio.wait(loops, timeout=2.0)
        assert drain_loops() == []

        # A drain and an uncordon at once: the uncordon waits until the drain is registered,
        # then calls it off; no loop is left behind.
        c.now = 1.0
        beat_all()
        await asyncio.gather(gm.drain(2, dry_run=False), gm.uncordon(2))
        await asyncio.wait(drain_loops(), timeout=2.0)
        assert drain_loops() == [] and gm.drain_status(2)["draining"] is False
        cordons = [command for command in c.transport.commands() if command[1] != "move"]
        assert cordons == [(2, "drain", 2), (2, "uncordon", 2), (2, "drain", 2), (2, "uncordon", 2)]

    asyncio.run(scenario())


class RefusingMoves(RecordingTransport):
    """Takes Drain, refuses every MoveKV (the destination is short of room in fact)."""

    async def request(self, peer, message, timeout_s=None):
        await super().request(peer, message, timeout_s)
        if isinstance(message, MoveKV):
            raise RemoteError(peer, ErrorCode.HANDLER_FAILED, "no room at the destination")
        return Ack()


def test_a_drain_report_keeps_the_latest_round_s_moves_and_counts_the_rest(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    gm.transport = c.transport = RefusingMoves()

    def beat_all() -> None:
        c.now += 0.1
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 2, 12)), borrowed=12)
        c.beat(2, 30, 1, upserts=((5, 2, 10),), lent=12)
        c.beat(3, 50, 0)

    async def scenario() -> None:
        beat_all()
        await gm.drain(2, dry_run=False)
        for num_rounds in range(1, 6):
            # Newer heartbeats until this round's two moves were sent (and refused).
            def sent_this_round(n=num_rounds) -> bool:
                beat_all()
                return total_sent(gm.drain_status(2)) >= 2 * n
            await until(sent_this_round)
        status = gm.drain_status(2)
        assert sorted((m["kind"], m["req_id"], m["result"]) for m in status["moves"]) == [
            ("held", 7, "refused"), ("own", 5, "refused")]
        assert status["move_results"] == {"held": {"refused": 5}, "own": {"refused": 5}}
        assert gm.status()["moves"] == {"refused": 10}
        gm._drains[2].task.cancel()

    asyncio.run(scenario())


def test_a_new_leader_takes_an_instance_whose_record_says_draining_for_draining(tmp_path) -> None:
    """A leader that knows of no drain (it took over from one that drained instance 3, or 3 is
    stopping) still reads 3's membership record, which says it drains: 3 is named as no creditor,
    the policy and drains place nothing there, and status says it drains."""
    c = Cluster(tmp_path)
    gm = c.gm
    c.beat(1, 0, 1, upserts=((7, 1, 64),))  # a debtor with a full pool
    c.beat(2, 63, 0)
    c.beat(3, 64, 0)  # the roomiest: the first choice of everything that places blocks
    c.publish(3, draining=True)

    async def scenario() -> None:
        assert gm._drains == {}
        reply = await gm.handle(heartbeat(1, 100, 64, 0, 1, 0, 100, upserts=((7, 1, 64),)))
        assert [h.inst_id for h in reply.creditors] == [2]
        moves = (await gm.rebalance(dry_run=True))["moves"]
        assert moves and {m["dst_inst_id"] for m in moves} == {2}
        plan = await gm.drain(1, dry_run=True)
        assert [(m["req_id"], m["dst_inst_id"], m["num_blocks"]) for m in plan["moves"]] == [(7, 2, 63)]
        assert plan["num_blocks_free_elsewhere"] == 63
        assert {i["instance_id"]: i["draining"] for i in gm.status()["instances"]} == {1: False, 2: False, 3: True}
        report = gm.drain_status(3)
        assert (report["draining"], report["state"], report["safe_to_stop"]) == (True, "not_draining", False)
        assert gm.drain_status(2)["draining"] is False

        # Uncordoned (by an earlier leader, or by hand): its next record says so, and it takes blocks again.
        c.publish(3, draining=False)
        reply = await gm.handle(heartbeat(1, 101, 64, 0, 1, 100, 101))
        assert [h.inst_id for h in reply.creditors] == [3, 2]
        assert 3 in {m["dst_inst_id"] for m in (await gm.rebalance(dry_run=True))["moves"]}
        assert not any(i["draining"] for i in gm.status()["instances"])
        assert c.transport.sent == []

    asyncio.run(scenario())
