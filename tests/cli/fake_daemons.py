"""Stand-in daemons for `infctl` tests: real processes on real Unix sockets, scripted answers.

    python fake_daemons.py instance STATE_DIR MODE   # MODE: ok | error | silent | crash | text500
    python fake_daemons.py gmanager STATE_DIR MODE   # MODE: called_off | standby

An instance serves the daemon's own LocalApp (so its answers are framed as the real ones) over a
scripted service, and rewrites `members/1.json` every second as a live instance does. A gManager
publishes `gmanager/leader.json` naming itself. Each prints "ready" once it can be reached.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from aiohttp import web

from infinite_llm.daemon.http_api import GenerationEvent, LocalApp, start_local_site
from infinite_llm.daemon.metrics import InstanceMetrics


class ScriptedInstance:
    """Instance 1: ``mode`` says how its requests end."""

    served_model = "m"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.metrics = InstanceMetrics()

    async def generate(self, prompt, messages, params, refuse_past_context=False, prefill=None):
        if self.mode == "silent":  # queued behind others for longer than the client waits
            await asyncio.sleep(3600)
        if self.mode == "crash":  # an unexpected error: the local API answers 500 naming it, in JSON
            raise RuntimeError("scripted failure")
        if self.mode == "text500":  # a 500 with a text body (as a proxy in between may answer)
            raise web.HTTPInternalServerError(text="500 Internal Server Error\n\nServer got itself in trouble")
        yield GenerationEvent("1", "The pass key", (5, 6, 7), False, None, 3, 3)
        if self.mode == "error":  # what the instance sends when a step fails or a peer is lost
            yield GenerationEvent("1", "", (), True, "error", 3, 3)
        else:
            yield GenerationEvent("1", " is 1.", (8,), True, "stop", 3, 4)

    def status(self):
        return {"instance_id": 1, "model": "m", "draining": False, "epoch": 0, "requests": [], "held_segments": [],
                "pool": {"num_blocks_total": 40, "num_blocks_free": 40, "num_blocks_held_for_others": 0,
                         "num_blocks_reserved_for_others": 0, "block_size": 16}}

    async def drain(self):
        return {"safe_to_stop": True, "running_requests": 0, "blocks_held_for_others": 0}

    async def uncordon(self):
        return {}


async def run_instance(state: Path, mode: str) -> None:
    runner = web.AppRunner(LocalApp(ScriptedInstance(mode), None).build(), handler_cancellation=True)
    await runner.setup()
    socket_path = state / "i1.sock"
    await start_local_site(runner, socket_path, None)
    (state / "members").mkdir(parents=True, exist_ok=True)
    print("ready", flush=True)
    while True:
        record = dict(inst_id=1, pid=os.getpid(), peer_host="127.0.0.1", peer_port=1, http_port=0,
                      socket_path=str(socket_path), num_blocks_total=40, num_blocks_free=40, draining=False,
                      updated_at=time.time())
        tmp = state / "members" / "1.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, state / "members" / "1.json")
        await asyncio.sleep(1.0)


def gmanager_app(mode: str) -> web.Application:
    async def post_drain(request: web.Request) -> web.Response:
        if mode == "standby":
            return web.json_response({"error": f"pid {os.getpid()} is a standby; only the leader drains"}, status=503)
        return web.json_response({"instance_id": 2, "epoch": 1, "draining": True, "state": "draining",
                                  "safe_to_stop": False, "running_requests": 1, "blocks_held_for_others": 0,
                                  "moves": [], "planned_moves": []})

    async def get_drain(request: web.Request) -> web.Response:
        # What the leader answers once an `uncordon` from elsewhere called the drain off.
        return web.json_response({"instance_id": 2, "epoch": 1, "draining": False, "running_requests": 1,
                                  "blocks_held_for_others": 0, "state": "not_draining", "safe_to_stop": False})

    async def post_uncordon(request: web.Request) -> web.Response:
        if mode == "standby":
            return web.json_response({"error": f"pid {os.getpid()} is a standby; only the leader uncordons"},
                                     status=503)
        return web.json_response({"instance_id": 2, "draining": False})

    app = web.Application()
    app.router.add_post("/v1/drain", post_drain)
    app.router.add_get("/v1/drain/{inst_id}", get_drain)
    app.router.add_post("/v1/uncordon", post_uncordon)
    return app


async def run_gmanager(state: Path, mode: str) -> None:
    runner = web.AppRunner(gmanager_app(mode))
    await runner.setup()
    socket_path = state / "gm.sock"
    await web.UnixSite(runner, str(socket_path)).start()
    (state / "gmanager").mkdir(parents=True, exist_ok=True)
    (state / "gmanager" / "leader.json").write_text(json.dumps({"pid": os.getpid(), "epoch": 1,
                                                                "socket_path": str(socket_path)}))
    print("ready", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    role, state_dir, how = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    asyncio.run(run_instance(state_dir, how) if role == "instance" else run_gmanager(state_dir, how))
