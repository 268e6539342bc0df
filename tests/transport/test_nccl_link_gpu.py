"""The per-layer exchange with a creditor on another host: a two-rank NCCL link between two
processes, its layers captured as one graph on each side, and a link whose peer is gone ended
by ``abort``.

The two processes share this machine's GPU; each names a host of its own (``NCCL_HOSTID``), so
NCCL treats them as two hosts and carries the bytes over its network transport (sockets on the
loopback here, InfiniBand between real hosts), as it would between the home and a creditor of
another machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

NUM_LAYERS, ROWS, HEADS, HEAD_DIM = 4, 3, 8, 64
WAIT_S = 60.0


def _as_another_host(rank: int) -> None:
    from infinite_llm.transport.nccl_link import loopback_host_env

    os.environ.update(loopback_host_env(f"infinite-llm-test-host-{rank}"))


def _rank_main(rank: int, mode: str, ids, results) -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(WAIT_S - 10, exit=False, file=sys.stderr)  # where a hang is
    _as_another_host(rank)
    try:
        from infinite_llm.transport.nccl_link import NcclLink, new_unique_id

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        if rank == 0:
            uid = new_unique_id()
            ids.put(uid)
        else:
            uid = ids.get(timeout=WAIT_S)
        link = NcclLink(uid, rank, device)
        q = torch.zeros(NUM_LAYERS, ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        out = torch.zeros_like(q)
        lse = torch.zeros(NUM_LAYERS, ROWS, HEADS, dtype=torch.float32, device=device)
        stream = torch.cuda.Stream(device)
        if mode == "abort":
            if rank == 1:
                results.put((rank, "gone"))
                return  # the creditor dies: the home's receive is never matched
            with torch.cuda.stream(stream):
                link.recv(out[0])
                done = torch.cuda.Event()
                done.record()
            time.sleep(1.0)
            waited = not done.query()
            link.abort()
            deadline = time.monotonic() + 20.0
            while not done.query() and time.monotonic() < deadline:
                time.sleep(0.01)
            results.put((rank, {"waited": waited, "ended": done.query()}))
            return

        def layers(step: torch.Tensor) -> None:
            for layer in range(NUM_LAYERS):
                if rank == 0:  # the home: its query out, the creditor's part back
                    q[layer].copy_(step * (layer + 1))
                    link.send(q[layer])
                    with link.group():
                        link.recv(out[layer])
                        link.recv(lse[layer])
                else:  # the creditor: the query in, a part computed from it out
                    link.recv(q[layer])
                    out[layer].copy_(q[layer] * 2)
                    lse[layer].copy_(q[layer].float().sum(-1))
                    with link.group():
                        link.send(out[layer])
                        link.send(lse[layer])

        step = torch.zeros(ROWS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        seen = []
        with torch.cuda.stream(stream):
            step.fill_(1.0)
            layers(step)  # eagerly: the connection is made outside any capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Thread-local: NCCL's proxy thread calls CUDA meanwhile, which a global capture forbids.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                layers(step)
            for value in (2.0, 3.0, 5.0):
                step.fill_(value)
                graph.replay()
                stream.synchronize()
                if rank == 0:
                    expected_out = torch.stack([torch.full_like(step, 2 * value * (layer + 1))
                                                for layer in range(NUM_LAYERS)])
                    expected_lse = expected_out.float().sum(-1) / 2
                    seen.append(bool(torch.equal(out, expected_out)) and bool(torch.equal(lse, expected_lse)))
        del graph
        link.abort()  # as the daemons end a link (NcclLink.abort says why)
        results.put((rank, seen))
    except BaseException as exc:  # noqa: BLE001  (reported to the test)
        results.put((rank, f"failed: {type(exc).__name__}: {exc}"))


def _run_pair(mode: str) -> dict:
    ctx = mp.get_context("spawn")
    ids, results = ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=_rank_main, args=(rank, mode, ids, results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    got = {}
    try:
        for _ in ranks:
            try:
                rank, value = results.get(timeout=WAIT_S)
            except queue.Empty:
                break  # what came is reported below
            got[rank] = value
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return got


def test_a_step_of_layers_crosses_a_link_as_one_graph_on_each_side() -> None:
    got = _run_pair("exchange")
    assert got.get(1) == [], got
    assert got[0] == [True, True, True], got


def test_a_wait_on_a_peer_that_is_gone_ends_when_the_link_is_aborted() -> None:
    got = _run_pair("abort")
    assert got.get(1) == "gone", got
    assert got[0] == {"waited": True, "ended": True}, got
