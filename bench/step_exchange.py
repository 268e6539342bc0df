"""The per-layer exchange of the step protocol between two processes of one GPU (or host).

The creditor is a child process running the daemon's ``StepServer`` over a KV pool of its own
(random keys, ``--keys`` of them for one request, every layer); the home, this process, maps the
creditor's mailbox as ``MailboxRemoteAttention`` does and, per step, sends the ``StepBegin``
(over a pipe here: the daemons send it over UCX), waits until the creditor queued the step,
then queues its layers: the query's copy into the mailbox and its flag, then its own part, the
stream wait for the result and the merge. Timed with CUDA events on the home's stream, medians
over ``--steps`` steps, fresh random queries each step:

- ``exchange``: the query out and the result back per layer, the creditor attending over its
  keys (what a home waits for a creditor's part);
- ``serve``: the creditor's attention alone, the same plan, timed in the creditor process;
- the remote overhead, ``exchange - serve``: what the mailbox adds to the creditor's work;
- ``copy``: the same bytes copied within one process (the query in, the output and
  log-sum-exp back), the floor of any exchange;
- ``split``: a layer of a split decode, half the keys here and half on the creditor, merged;
  against ``local``: all the keys here, one process.

    python bench/step_exchange.py                       # the CPU: host mailbox, small shapes
    python bench/step_exchange.py --device cuda --keys 61440   # Llama-3.2-1B shapes, 120K split
    python bench/step_exchange.py --device cuda --link nccl    # as a creditor of another host

``--link nccl``: the layers cross a two-rank NCCL link (``transport/nccl_link.py``) instead of a
shared mailbox, the two processes naming hosts of their own (``NCCL_HOSTID``), so NCCL carries
them over its network transport (sockets on the loopback of one machine): the path of a creditor
on another host, with this machine's loopback in place of the network.

Writes ``bench/results/step_exchange-<gpu or cpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

BLOCK_SIZE = 16


def make_pool(num_blocks: int, layers: int, kv_heads: int, head_dim: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = torch.randn(num_blocks, layers, 2, BLOCK_SIZE, kv_heads, head_dim, generator=g, dtype=torch.float32)
    return pool.to(device=device, dtype=torch.bfloat16 if device != "cpu" else torch.float32)


def creditor_main(conn, args_dict: dict, host_dir: str) -> None:
    """The creditor: a StepServer over a pool holding ``keys`` tokens of request 1 of home 1."""
    from infinite_llm.daemon.creditor import CreditorAttention
    from infinite_llm.daemon.ledger import CreditorLedger
    from infinite_llm.daemon.step_server import StepServer
    from infinite_llm.kernels import run_micro_attention

    a = argparse.Namespace(**args_dict)
    if a.link == "nccl":
        as_host("creditor")
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # the current device wants an index
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the two processes share the host's cores
    num_blocks = -(-a.keys // BLOCK_SIZE)
    pool = make_pool(num_blocks + 4, a.layers, a.kv_heads, a.head_dim, a.device, seed=2)
    free = list(range(num_blocks + 4))

    def allocate(n):
        taken = free[:n]
        del free[:n]
        return taken

    ledger = CreditorLedger(allocate, free.extend, reservation_ttl_s=1e9, hold_ttl_s=1e9)
    reservation = ledger.reserve(1, 1, num_blocks, now=0.0)
    ledger.commit(reservation.reservation_id, 1, 1, 0, now=0.0)
    server = StepServer(CreditorAttention(ledger, pool, a.heads), host_id="bench", timeout_s=60.0,
                        host_dir=Path(host_dir))
    conn.send(server.open(conn.recv()))
    while True:
        message = conn.recv()
        if message is None:
            break
        if message == "serve":  # the attention alone, the same plan, timed here
            served = server.planner.plan_for(1, (server_slice(a),))
            q = torch.randn(a.rows, a.heads, a.head_dim, device=device, dtype=pool.dtype)
            times = []
            for _ in range(a.steps):
                t = Timer(device)
                for layer in range(a.layers):
                    run_micro_attention(served.plan, q, pool, layer, sm_scale=a.head_dim ** -0.5, out_dtype=pool.dtype)
                times.append(t.elapsed_s() / a.layers)
            conn.send(statistics.median(times))
            continue
        server.begin(message)
        conn.send("queued")
        server.check_deadlines()
    server.close_all()


def as_host(name: str) -> None:
    """Before this process's first NCCL call: a host of its own, over the loopback."""
    from infinite_llm.transport.nccl_link import loopback_host_env

    os.environ.update(loopback_host_env(f"infinite-llm-bench-{name}"))


def server_slice(a):
    from infinite_llm.transport.messages import AttendSlice
    return AttendSlice(1, 0, a.rows, 0, a.keys) if a.rows == 1 else AttendSlice(1, 0, a.rows, 0, a.keys)


class Timer:
    """Elapsed time of the work queued between its making and ``elapsed_s`` (CUDA events on a
    GPU, the wall clock on the host)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def elapsed_s(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return time.perf_counter() - self.t0


def receive(conn, creditor, timeout_s: float = 120.0):
    """The creditor's next answer; RuntimeError if it died or said nothing within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not creditor.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the creditor process {'exited' if not creditor.is_alive() else 'did not answer'}")
    return conn.recv()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--keys", type=int, default=None, help="keys the creditor holds (default 61440 on a GPU, 512 on the CPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--link", choices=("mailbox", "nccl"), default="mailbox",
                        help="a shared mailbox (one host), or an NCCL link (as between hosts)")
    args = parser.parse_args()
    if args.link == "nccl" and args.device == "cpu":
        parser.error("--link nccl needs --device cuda")
    if args.keys is None:
        args.keys = 61440 if args.device != "cpu" else 512
    if args.steps is None:
        args.steps = 200 if args.device != "cpu" else 20
    if args.device == "cpu":
        args.layers, args.heads, args.kv_heads = min(args.layers, 4), min(args.heads, 8), min(args.kv_heads, 2)

    from infinite_llm.kernels import merge_two_attention_states, plan_micro_attention, run_micro_attention, AttentionState
    from infinite_llm.transport.messages import StepBegin, StepMailboxOpen
    from infinite_llm.transport.step_mailbox import (FLAG_EMPTY, FLAG_READY, flag_address, layout_of, open_mailbox,
                                                     stream_flags)
    from infinite_llm.transport.tensors import TORCH_DTYPE_NAMES

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = mp.get_context("spawn")
    host_dir = tempfile.mkdtemp(prefix="infllm-mailbox-")
    parent, child = ctx.Pipe()
    creditor = ctx.Process(target=creditor_main, args=(child, vars(args), host_dir), daemon=True)
    creditor.start()
    dtype_name = TORCH_DTYPE_NAMES[dtype]
    layout = layout_of(args.layers, args.rows, args.heads, args.head_dim, dtype_name)
    link = None
    if args.link == "nccl":
        as_host("home")
        from infinite_llm.transport.nccl_link import NcclLink, new_unique_id
        from infinite_llm.transport.step_mailbox import make_local_mailbox
        unique_id = new_unique_id()
        parent.send(StepMailboxOpen(1, 2, args.layers, args.rows, args.heads, args.head_dim, dtype_name, "bench",
                                    nccl_id=unique_id.hex()))
        opened = receive(parent, creditor)
        link = NcclLink(unique_id, 0, device)  # returns once the creditor made its end too
        mailbox = make_local_mailbox(layout, device)
    else:
        parent.send(StepMailboxOpen(1, 2, args.layers, args.rows, args.heads, args.head_dim, dtype_name, "bench"))
        opened = receive(parent, creditor)
        mailbox = open_mailbox(layout, opened.nbytes, device, opened.device[0] if opened.device else None,
                               opened.host_path)
    slices = (server_slice(args),)
    flags = stream_flags() if device.type == "cuda" else None
    n, L = args.rows, args.layers
    sm_scale = args.head_dim ** -0.5

    # The home's own half: as many keys as the creditor's, in a pool of this process.
    num_blocks = -(-args.keys // BLOCK_SIZE)
    home_pool = make_pool(2 * num_blocks, L, args.kv_heads, args.head_dim, args.device, seed=1)

    def plan_over(blocks: int, keys: int):
        table = torch.arange(blocks, dtype=torch.int32, device=device).view(1, -1).repeat(n, 1)
        return plan_micro_attention(table, torch.full((n,), keys, dtype=torch.int32, device=device),
                                    torch.arange(n + 1, dtype=torch.int32, device=device),
                                    num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                    block_size=BLOCK_SIZE, num_blocks=home_pool.shape[0], max_query_len=1,
                                    max_kv_len=blocks * BLOCK_SIZE, check_bounds=device.type != "cuda")
    half_plan, full_plan = plan_over(num_blocks, args.keys), plan_over(2 * num_blocks, 2 * args.keys)

    def send_q(layer: int, q: torch.Tensor) -> None:
        mailbox.q[layer, :n].copy_(q)
        if link is not None:
            link.send(mailbox.q[layer, :n])
        elif flags is not None:
            flags.write(flag_address(mailbox.q_flags, layer), FLAG_READY)
        else:
            mailbox.q_flags[layer] = FLAG_READY

    def take_result(layer: int) -> AttentionState:
        if link is not None:
            with link.group():
                link.recv(mailbox.out[layer, :n])
                link.recv(mailbox.lse[layer, :n])
        elif flags is not None:
            address = flag_address(mailbox.result_flags, layer)
            flags.wait(address, FLAG_READY)
            flags.write(address, FLAG_EMPTY)
        else:
            while int(mailbox.result_flags[layer]) < FLAG_READY:
                pass
            mailbox.result_flags[layer] = FLAG_EMPTY
        return AttentionState(mailbox.out[layer, :n], mailbox.lse[layer, :n])

    step_ids = iter(range(1, 1 << 30))

    def exchange_step(split: bool) -> tuple[float, float]:
        """One step's layers through the mailbox: (per-layer time, StepBegin's round trip)."""
        qs = torch.randn(L, n, args.heads, args.head_dim, device=device, dtype=dtype)
        t0 = time.perf_counter()
        parent.send(StepBegin(1, 2, opened.mailbox_id, next(step_ids), L, slices, n,
                              wire_rows=n if link is not None else 0))
        assert receive(parent, creditor) == "queued"
        begin_s = time.perf_counter() - t0
        timer = Timer(device)
        for layer in range(L):
            send_q(layer, qs[layer])
            if split:
                local = run_micro_attention(half_plan, qs[layer], home_pool, layer, sm_scale=sm_scale,
                                            out_dtype=torch.float32)
                merge_two_attention_states(local, take_result(layer), out_dtype=dtype)
            else:
                take_result(layer).out.sum()
        return timer.elapsed_s() / L, begin_s

    def local_step() -> float:
        qs = torch.randn(L, n, args.heads, args.head_dim, device=device, dtype=dtype)
        timer = Timer(device)
        for layer in range(L):
            run_micro_attention(full_plan, qs[layer], home_pool, layer, sm_scale=sm_scale, out_dtype=dtype)
        return timer.elapsed_s() / L

    def copy_step() -> float:
        qs = torch.randn(L, n, args.heads, args.head_dim, device=device, dtype=dtype)
        q_to = torch.empty_like(qs)
        out_from = torch.randn_like(qs)
        lse_from = torch.randn(L, n, args.heads, device=device)
        out_to, lse_to = torch.empty_like(out_from), torch.empty_like(lse_from)
        timer = Timer(device)
        for layer in range(L):
            q_to[layer].copy_(qs[layer])
            out_to[layer].copy_(out_from[layer])
            lse_to[layer].copy_(lse_from[layer])
        return timer.elapsed_s() / L

    for _ in range(5):  # warm-up: the creditor's first steps run eagerly, then its graph is captured
        exchange_step(False), exchange_step(True), local_step(), copy_step()
    results: dict[str, list[float]] = {"exchange": [], "split": [], "local": [], "copy": [], "begin": []}
    for _ in range(args.steps):  # interleaved, so that drift is shared
        per_layer, begin_s = exchange_step(False)
        results["exchange"].append(per_layer)
        results["begin"].append(begin_s)
        results["split"].append(exchange_step(True)[0])
        results["local"].append(local_step())
        results["copy"].append(copy_step())
    parent.send("serve")
    serve_s = receive(parent, creditor)
    parent.send(None)
    creditor.join(timeout=30)

    med = {k: statistics.median(v) for k, v in results.items()}
    gpu = torch.cuda.get_device_name().replace(" ", "-") if device.type == "cuda" else "cpu"
    q_bytes = n * args.heads * args.head_dim * dtype.itemsize
    report = {
        "device": gpu, "machine": platform.node(), "torch": torch.__version__, "link": args.link,
        "layers": L, "rows": n,
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "creditor_keys": args.keys,
        "steps": args.steps, "query_bytes": q_bytes, "result_bytes": q_bytes + n * args.heads * 4,
        "median_us_per_layer": {k: 1e6 * v for k, v in med.items() if k != "begin"} | {"serve": 1e6 * serve_s},
        "step_begin_round_trip_us": 1e6 * med["begin"],
        "remote_overhead_us_per_layer": 1e6 * (med["exchange"] - serve_s),
        "exchange_vs_copy_plus_serve": med["exchange"] / (med["copy"] + serve_s),
        "split_vs_local": med["local"] / med["split"],
    }
    link_tag = "-nccl" if args.link == "nccl" else ""
    out = Path(args.out_dir) / f"step_exchange-{gpu}{link_tag}{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"{'per layer':>28} {'us':>9}")
    for name, us in report["median_us_per_layer"].items():
        print(f"{name:>28} {us:9.1f}")
    print(f"{'remote overhead':>28} {report['remote_overhead_us_per_layer']:9.1f}")
    print(f"{'split attention vs local':>28} {report['split_vs_local']:9.3f}x")


if __name__ == "__main__":
    main()
