"""The step protocol's device path: stream memory operations, a creditor's step captured as one
graph, and a mailbox shared between two processes of one GPU (CUDA IPC)."""

from __future__ import annotations

import math
import multiprocessing as mp
import time

import pytest
import torch

from infinite_llm.transport.step_mailbox import (
    FLAG_ABORTED,
    FLAG_EMPTY,
    FLAG_READY,
    Mailbox,
    MailboxLayout,
    flag_address,
    stream_flags,
)

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 8, 2, 64, 16, 4


def test_a_stream_waits_for_a_flag_another_stream_sets_and_graphs_capture_both() -> None:
    flags = stream_flags()
    word = torch.zeros(16, dtype=torch.int32, device="cuda")
    waiter, writer = torch.cuda.Stream(), torch.cuda.Stream()
    out = torch.zeros(1, device="cuda")
    with torch.cuda.stream(waiter):
        flags.wait(word.data_ptr(), FLAG_READY)
        out.fill_(1.0)
    time.sleep(0.05)
    assert not waiter.query(), "the wait ended with no flag set"
    flags.write(word.data_ptr(), FLAG_READY, writer)
    waiter.synchronize()
    assert out.item() == 1.0
    # Captured: a graph that waits, clears the flag and writes, replayed twice.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        word.zero_()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            flags.wait(word.data_ptr(), FLAG_READY)
            flags.write(word.data_ptr(), FLAG_EMPTY)
            out.add_(1.0)
    for expected in (2.0, 3.0):
        with torch.cuda.stream(side):
            graph.replay()
        time.sleep(0.02)
        assert not side.query()
        flags.write(word.data_ptr(), FLAG_READY, writer)
        side.synchronize()
        assert out.item() == expected and int(word[0]) == FLAG_EMPTY


def _creditor(conn) -> None:
    """A StepServer over a random pool, serving one home through a device mailbox."""
    from infinite_llm.daemon.creditor import CreditorAttention
    from infinite_llm.daemon.ledger import CreditorLedger
    from infinite_llm.daemon.step_server import StepServer

    torch.manual_seed(0)
    pool = torch.randn(8, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    free = list(range(8))
    ledger = CreditorLedger(lambda n: [free.pop(0) for _ in range(n)], free.extend, reservation_ttl_s=1e9,
                            hold_ttl_s=1e9)
    r = ledger.reserve(1, 7, 4, now=0.0)
    ledger.commit(r.reservation_id, 1, 7, 0, now=0.0)
    server = StepServer(CreditorAttention(ledger, pool, NUM_HEADS), host_id="h", timeout_s=float(conn.recv()))
    conn.send((server.open(conn.recv()), pool.cpu(), list(ledger.held.values())[0].block_ids))
    while (message := conn.recv()) is not None:
        if message == "tick":
            conn.send(server.check_deadlines())
            continue
        conn.send(server.handle(message))
    conn.send((server.steps_begun, server.graph_replays, server.timeouts))


def _reference(pool, block_ids, num_tokens, layer, q):
    k = pool[list(block_ids), layer, 0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:num_tokens].double()
    v = pool[list(block_ids), layer, 1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:num_tokens].double()
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("rhd,nhd->rhn", q.double(), k) / math.sqrt(HEAD_DIM)
    return torch.einsum("rhn,nhd->rhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def _answer(conn, process, timeout_s: float = 60.0):
    """The creditor's next answer, within ``timeout_s``; fails if it died or hangs."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        assert process.is_alive(), "the creditor process died"
        assert time.monotonic() < deadline, "the creditor did not answer"
    return conn.recv()


def _synchronize(stream: torch.cuda.Stream | None = None, timeout_s: float = 30.0) -> None:
    """Wait for the stream (default: every stream of the device) within ``timeout_s``: a wait
    on a flag that never comes fails the test rather than hang it."""
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.query():
        assert time.monotonic() < deadline, "the device did not finish the step"
        time.sleep(0.001)
    if stream is None:
        torch.cuda.synchronize()


def test_two_processes_exchange_every_layer_through_a_device_mailbox_and_a_dead_step_is_released() -> None:
    from infinite_llm.transport.messages import Ack, AttendSlice, StepBegin, StepMailboxOpen
    from infinite_llm.transport.step_mailbox import STATUS_OK, STATUS_TIMED_OUT, layout_of, open_mailbox

    ctx = mp.get_context("spawn")
    home_end, creditor_end = ctx.Pipe()
    process = ctx.Process(target=_creditor, args=(creditor_end,), daemon=True)
    process.start()
    try:
        home_end.send(2.0)
        home_end.send(StepMailboxOpen(1, 2, NUM_LAYERS, 2, NUM_HEADS, HEAD_DIM, "bfloat16", "h"))
        opened, pool, block_ids = _answer(home_end, process)
        layout = layout_of(NUM_LAYERS, 2, NUM_HEADS, HEAD_DIM, "bfloat16")
        mailbox = open_mailbox(layout, opened.nbytes, torch.device("cuda"), opened.device[0], "")
        flags = stream_flags()
        slices = (AttendSlice(7, 0, 1, 0, 60),)
        for step_id in range(1, 5):  # eager, captured, then replays
            home_end.send(StepBegin(1, 2, opened.mailbox_id, step_id, NUM_LAYERS, slices, 1))
            assert isinstance(_answer(home_end, process), Ack)
            qs = torch.randn(NUM_LAYERS, 1, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            results = []
            for layer in range(NUM_LAYERS):
                mailbox.q[layer, :1].copy_(qs[layer])
                flags.write(flag_address(mailbox.q_flags, layer), FLAG_READY)
                flags.wait(flag_address(mailbox.result_flags, layer), FLAG_READY)
                flags.write(flag_address(mailbox.result_flags, layer), FLAG_EMPTY)
                results.append((mailbox.out[layer, :1].clone(), mailbox.lse[layer, :1].clone()))
            _synchronize(torch.cuda.current_stream())
            assert int(mailbox.status[0]) == STATUS_OK
            for layer, (out, lse) in enumerate(results):
                ref_out, ref_lse = _reference(pool, block_ids, 60, layer, qs[layer].cpu().float())
                torch.testing.assert_close(out.cpu().double(), ref_out, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=2e-2, rtol=2e-2)
        # A step whose home stops after its first layer: the creditor's watchdog gives it up,
        # and the home, waiting on its stream, is released by its own watchdog.
        home_end.send(StepBegin(1, 2, opened.mailbox_id, 5, NUM_LAYERS, slices, 1))
        assert isinstance(_answer(home_end, process), Ack)
        mailbox.q[0, :1].copy_(qs[0])
        flags.write(flag_address(mailbox.q_flags, 0), FLAG_READY)
        waiting = torch.cuda.Stream()
        with torch.cuda.stream(waiting):
            flags.wait(flag_address(mailbox.result_flags, 1), FLAG_READY)
        time.sleep(2.5)
        home_end.send("tick")
        assert _answer(home_end, process) == [(1, 5)]
        _synchronize(waiting)  # the creditor's aborted waits let its graph end, and with it layer 1's flag
        assert int(mailbox.status[0]) == STATUS_TIMED_OUT
        with torch.cuda.stream(waiting):
            flags.wait(flag_address(mailbox.result_flags, 3), FLAG_READY + 5)  # never set by anyone
        flags.write(flag_address(mailbox.result_flags, 3), FLAG_ABORTED + 5, torch.cuda.Stream())
        _synchronize(waiting)
        home_end.send(None)
        begun, replays, timeouts = _answer(home_end, process)
        assert (begun, timeouts) == (5, 1) and replays >= 3
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
