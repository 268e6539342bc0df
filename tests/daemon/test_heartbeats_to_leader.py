"""An instance finds the leader in the state folder and heartbeats to it over UCX.

The leader here is this test process: a real UCX listener that records heartbeats, answers them,
and asks once for the full placement, as a new leader would.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt
from infinite_llm.transport.interface import TransportConfig
from infinite_llm.transport.messages import CreditorHint, Heartbeat, HeartbeatReply
from infinite_llm.transport.placement import PlacementGap, VersionedPlacement, apply_heartbeat


def test_instances_heartbeat_to_the_leader_with_their_placement(tmp_path):
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from infinite_llm.transport.ucx import UcxTransport

    received: list[Heartbeat] = []
    held: dict[int, VersionedPlacement] = {}
    asked_full = set()

    async def leader_handler(message):
        assert isinstance(message, Heartbeat)
        received.append(message)
        base = held.get(message.inst_id, VersionedPlacement(0, {}))
        if message.inst_id not in asked_full and message.placement_base_version != 0:
            asked_full.add(message.inst_id)
            return HeartbeatReply(7, base.version, True, ())
        try:
            held[message.inst_id] = apply_heartbeat(base, message)
        except PlacementGap:
            return HeartbeatReply(7, base.version, True, ())
        return HeartbeatReply(7, message.placement_version, False, (CreditorHint(2, 33),))

    loop = asyncio.new_event_loop()
    leader = UcxTransport(TransportConfig())
    loop.run_until_complete(leader.start(leader_handler))
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    cluster = LocalCluster(tmp_path, num_instances=2, pool_blocks=40, extra_args=["--heartbeat-interval-s", "0.3"])
    try:
        folder = cluster.state_dir / "gmanager"
        folder.mkdir(parents=True)
        (folder / "leader.json").write_text(json.dumps({
            "epoch": 7, "pid": os.getpid(), "peer_host": leader.address.host, "peer_port": leader.address.port}))
        cluster.wait_ready()
        tokens, _ = cluster[1].generate(passkey_prompt(60), max_tokens=30, ignore_eos=True)
        assert len(tokens) == 30
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (held.get(1) and held.get(2)):
            time.sleep(0.1)
        from_home = [h for h in received if h.inst_id == 1]
        assert from_home and [h.seq for h in from_home] == sorted(h.seq for h in from_home)
        # While the request ran, the home reported its blocks on itself and on instance 2.
        reported = {(e.inst_id, e.local) for h in from_home for e in h.placement_upserts}
        assert (1, True) in reported and (2, False) in reported
        assert max(h.pool.num_blocks_borrowed for h in from_home) > 0
        assert max(h.pool.num_blocks_lent for h in received if h.inst_id == 2) > 0
        # After the request, the placement the leader holds for the home is empty again.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and held[1].entries:
            time.sleep(0.1)
        assert held[1].entries == {}
        assert cluster[1].status()["epoch"] == 7
    finally:
        cluster.stop()
        asyncio.run_coroutine_threadsafe(leader.close(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
