"""Transport benchmark: bandwidth and round trips of the UCX transport, against anchors.

Two processes (this one and a server it starts). Measured side by side in one run:

- bandwidth of one-buffer ``KVBlocks`` messages of 64 KiB .. 64 MiB, received straight into a
  pool on the server, several in flight; anchor: a plain copy of the same bytes in this
  process (host memcpy, or device-to-device on the GPU), bytes counted once. Host buffers go
  through the transport's shared memory (copied into it); also measured: with the sources in
  it already (as a mover's staging buffers are), and with shared memory off (over UCX);
- a batch of N KV blocks scattered over the source pool, moved as the daemons move them (on
  the GPU, as row ids that the server copies out of the client's pool mapped through CUDA IPC;
  else gathered into one buffer for a contiguous reservation), against one contiguous run of
  the same bytes sent as one buffer; on the GPU also gathered and sent over UCX, the path to a
  peer on another host; and N runs into scattered destinations (the worst case). On the GPU
  the batch goes to two fresh servers started together: one replays its pulls from captured
  graphs (the default), the other launches them, each against its own contiguous anchor;
- round trip of a 1 KiB ``Echo`` (p50, p99), with the headers through the header ring (the
  default between local processes) and over UCX.

Bare ucxx anchors run in a second pair of processes (ucxx in ``polling`` mode, its lowest
latency; one UCX context per process, so they cannot share the transport's): a 1 KiB
send/recv ping-pong, and the bandwidth of the same message sizes sent ``--window`` at a time
into one preallocated buffer.

    python bench/transport.py                  # host memory, UCX_TLS=tcp,sm,self unless set
    python bench/transport.py --device cuda    # CUDA memory; UCX picks CUDA IPC on one GPU

Writes bench/results/transport-<cpu|gpu name>.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "cuda" not in sys.argv:  # on a GPU machine UCX picks its transports (CUDA IPC, NVLink)
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import ucxx  # noqa: E402

from infinite_llm.daemon.config import peer_spin_for  # noqa: E402
from infinite_llm.transport import messages as m  # noqa: E402
from infinite_llm.transport.codec import FrameLimits  # noqa: E402
from infinite_llm.transport.interface import PeerAddress, TransportConfig  # noqa: E402
from infinite_llm.transport.kv_packing import HostStaging, KVPacker  # noqa: E402
from infinite_llm.transport.shared_memory import default_copy_threads  # noqa: E402
from infinite_llm.transport.ucx import UCX_CONTEXT_OPTIONS, UcxTransport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
MESSAGE_SIZES = [64 * KiB, 1 * MiB, 4 * MiB, 64 * MiB]
POOL_BYTES = 256 * MiB
PING_BYTES = 1 * KiB
STAGING_SIZES = [1 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB]


# --- server ---------------------------------------------------------------------------------


async def serve(device: str, spin_s: float, inline_cuda_limit_bytes: int | None = None,
                copy_threads: int = 0, pull_graphs: bool = True) -> None:
    pool = torch.empty(POOL_BYTES, dtype=torch.uint8, device=device)

    def place(message: m.Message):
        if not isinstance(message, m.KVBlocks):
            return None
        # runs_data[i] is [num_blocks, block_nbytes] uint8; blocks sit at block_id * nbytes.
        views = []
        for run, spec in zip(message.runs, message.runs_data):
            block_nbytes = spec.shape[1]
            start = run.dst_block_id * block_nbytes
            views.append(pool[start:start + run.num_blocks * block_nbytes].view(spec.shape))
        return views

    def handle(message: m.Message) -> m.Message | None:  # answers at once, as the daemons' do
        if isinstance(message, m.Echo):
            return m.EchoReply(message.payload)
        if isinstance(message, m.KVBlocks):
            return m.KVBlocksStored(message.move_id, message.reservation_id,
                                    sum(r.num_blocks for r in message.runs))
        return None

    transport = UcxTransport(TransportConfig(receive_device=device, spin_s=spin_s,
                                             limits=limits_with(inline_cuda_limit_bytes),
                                             shared_memory_copy_threads=copy_threads, pull_graphs=pull_graphs))
    await transport.start(handle, place)
    print(f"PORT {transport.address.port}", flush=True)
    await asyncio.sleep(3600)


def event_loop_name() -> str:
    """uvloop where installed, as the daemons run, unless INFLLM_BENCH_LOOP=asyncio (inherited
    by the benchmark's other processes)."""
    if os.environ.get("INFLLM_BENCH_LOOP", "uvloop") == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_loop(coroutine):
    if event_loop_name() == "uvloop":
        import uvloop

        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def limits_with(inline_cuda_limit_bytes: int | None) -> FrameLimits:
    """Default frame limits, with device-buffer staging set when given (0: never staged)."""
    if inline_cuda_limit_bytes is None:
        return FrameLimits()
    return dataclasses.replace(FrameLimits(), inline_cuda_limit_bytes=inline_cuda_limit_bytes)


# --- bare ucxx anchors (their own pair of processes) ----------------------------------------

# A bare client first sends a control array [mode, nbytes, count]: PING echoes count
# messages of nbytes; STREAM receives count messages of nbytes and then answers one byte.
PING, STREAM = 0, 1


def buffer_of(nbytes: int, device: str, random: bool = False):
    """A bare-loop buffer: a CUDA tensor (ucxx reads __cuda_array_interface__) or, on the host,
    a numpy array (a CPU tensor exposes no buffer interface to ucxx)."""
    if random:
        tensor = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    else:
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return tensor if device.startswith("cuda") else tensor.numpy()


def init_bare_ucx(device: str) -> None:
    if device.startswith("cuda"):
        torch.empty(1, device=device)  # the CUDA context exists before UCX starts
    ucxx.init(options=UCX_CONTEXT_OPTIONS, progress_mode="polling")


async def serve_bare(device: str) -> None:
    init_bare_ucx(device)

    async def serve_endpoint(endpoint) -> None:
        control = np.empty(3, dtype=np.int64)
        done = np.ones(1, dtype=np.uint8)
        try:
            while True:
                await endpoint.recv(control)
                mode, nbytes, count = (int(x) for x in control)
                buffer = buffer_of(nbytes, device)
                if mode == PING:
                    for _ in range(count):
                        await endpoint.recv(buffer)
                        await endpoint.send(buffer)
                else:
                    for _ in range(count):
                        await endpoint.recv(buffer)
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    await endpoint.send(done)
        except Exception:  # noqa: BLE001  (the client closing ends the loop)
            return

    listener = ucxx.create_listener(serve_endpoint)
    print(f"PORT {listener.port}", flush=True)
    await asyncio.sleep(3600)


async def run_bare_client(args, port: int) -> dict:
    device = args.device
    init_bare_ucx(device)
    endpoint = await ucxx.create_endpoint("127.0.0.1", port)
    done = np.empty(1, dtype=np.uint8)

    async def ping(count: int) -> list[float]:
        out = buffer_of(PING_BYTES, device, random=True)
        back = buffer_of(PING_BYTES, device)
        await endpoint.send(np.array([PING, PING_BYTES, count], dtype=np.int64))
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            await endpoint.send(out)
            await endpoint.recv(back)
            samples.append(time.perf_counter() - t0)
        return samples

    async def stream(nbytes: int, count: int) -> float:
        sources = [buffer_of(nbytes, device, random=True) for _ in range(min(4, args.window))]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        await endpoint.send(np.array([STREAM, nbytes, count], dtype=np.int64))
        t0 = time.perf_counter()
        for first in range(0, count, args.window):
            batch = range(first, min(count, first + args.window))
            await asyncio.gather(*(endpoint.send(sources[i % len(sources)]) for i in batch))
        await endpoint.recv(done)
        return nbytes * count / (time.perf_counter() - t0)

    warm = args.round_trips // 10
    round_trips = (await ping(args.round_trips + warm))[warm:]
    bandwidth = {}
    for nbytes in MESSAGE_SIZES:
        await stream(nbytes, min(8, messages_for(nbytes)))  # warm-up
        bandwidth[nbytes] = await stream(nbytes, messages_for(nbytes))
    endpoint.abort()
    return {"round_trip": percentiles(round_trips), "bandwidth": bandwidth}


def measure_bare(args) -> dict:
    """The bare anchors, from a server and a client process of their own."""
    server, port = start_process(["--role", "bare-server", "--device", args.device])
    try:
        client = subprocess.run(
            [sys.executable, __file__, "--role", "bare-client", "--device", args.device,
             "--port", str(port), "--window", str(args.window),
             "--round-trips", str(args.round_trips)],
            stdout=subprocess.PIPE, text=True, check=True, timeout=600)
    finally:
        server.kill()
        server.wait(timeout=10)
    result = json.loads(client.stdout.strip().splitlines()[-1])
    result["bandwidth"] = {int(k): v for k, v in result["bandwidth"].items()}
    return result


# --- client ---------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int, device: str, repeats: int) -> float:
    """Bytes per second of a plain copy of ``nbytes`` (bytes counted once), rotating over as
    many source and destination buffers as the transport's figure does (``rotation_slots``):
    one pair copied again and again stays in the caches."""
    slots = rotation_slots(nbytes)
    sources = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(slots)]
    destinations = [torch.empty_like(src) for src in sources]
    times = []
    for i in range(repeats + 2):  # the first two warm up
        src, dst = sources[i % slots], destinations[i % slots]
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:])


def rotation_slots(nbytes: int) -> int:
    """How many buffers of ``nbytes`` a bandwidth figure rotates over."""
    return max(1, min(4, POOL_BYTES // nbytes // 2))


async def send_blocks(transport: UcxTransport, server: PeerAddress, runs_list, data_list,
                      num_messages: int, window: int, packed_move=None, to: PeerAddress | None = None) -> float:
    """Seconds to send ``num_messages`` KVBlocks (cycling over the given ones), ``window`` at
    a time in flight. ``packed_move``: (packer, pool, source block ids, destination block ids)
    sent instead as a daemon's mover sends a move (``KVPacker.send``: its gather is part of
    the time). ``to``: another server than ``server`` for these."""
    next_index = 0
    server = to or server

    async def worker() -> None:
        nonlocal next_index
        while next_index < num_messages:
            i = next_index
            next_index += 1
            k = i % len(runs_list)
            if packed_move is None:
                await transport.request(server, m.KVBlocks(i, 1, runs_list[k], data_list[k]), timeout_s=60)
            else:
                packer, pool, src_block_ids, dst_block_ids = packed_move
                await packer.send(transport, server, pool, src_block_ids, dst_block_ids,
                                  lambda runs, data: m.KVBlocks(i, 1, runs, data), 60)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(window)))
    return time.perf_counter() - t0


def one_run(nbytes: int, device: str, dst_block: int = 0):
    data = torch.randint(0, 255, (1, nbytes), dtype=torch.uint8, device=device)
    return (m.BlockRun(dst_block, 1),), (data,)


def messages_for(nbytes: int) -> int:
    return max(8, min(400, (512 * MiB) // nbytes))


async def measure_bandwidth(transport, server, device, nbytes: int, window: int,
                            shared_sources: bool = False) -> dict:
    """``shared_sources``: the sources lie in the transport's shared memory (as a mover's
    staging buffers do), so a local peer reads them with no copy into it."""
    num_messages = messages_for(nbytes)
    # Rotate over a few source buffers and destinations, so caches do not flatter the figure.
    slots = rotation_slots(nbytes)
    runs, datas = zip(*(one_run(nbytes, device, dst_block=i) for i in range(slots)))
    if shared_sources:
        datas = [tuple(shared_copy(transport, d) for d in data) for data in datas]
    await send_blocks(transport, server, runs, datas, min(num_messages, 8), window)  # warm-up
    seconds = await send_blocks(transport, server, runs, datas, num_messages, window)
    return {"bytes": nbytes, "messages": num_messages, "window": window,
            "bytes_per_s": nbytes * num_messages / seconds}


def shared_copy(transport: UcxTransport, tensor: torch.Tensor) -> torch.Tensor:
    buffer = transport.shared_host_buffer(tensor.nbytes)
    if buffer is None:
        raise RuntimeError("no shared memory for the sources")
    return buffer.view(tensor.dtype).view(tensor.shape).copy_(tensor)


async def measure_block_batch(transport, server, device, num_blocks: int, block_nbytes: int,
                              window: int, block_batch_rounds: int = 5, eager_server: PeerAddress | None = None) -> dict:
    """N KV blocks scattered over the source pool, moved as a daemon's mover moves them
    (``KVPacker.send``: to a local peer that mapped a device pool, as row ids that the peer
    copies out of the pool; else gathered on the sender into one buffer for a contiguous
    reservation, a device pool's gather waited for by polling its event from the event loop),
    against the same bytes already contiguous, sent as one buffer; the same blocks gathered
    and sent over UCX where the pool is mapped (the path to a peer on another host); and the
    worst case, N runs into N scattered destinations. ``eager_server``: a server whose pulls
    are launched eagerly rather than replayed from captured graphs, measured beside against
    its own contiguous anchor (servers of one GPU differ by more than that difference)."""
    source_pool = torch.randint(0, 255, (4 * num_blocks, block_nbytes), dtype=torch.uint8, device=device)
    scattered_ids = torch.randperm(4 * num_blocks)[:num_blocks].tolist()
    # The contiguous anchor rotates over the pool's four contiguous ranges, as the bandwidth
    # figures rotate over their buffers: one range sent again and again stays in the caches,
    # which the gathered blocks (spread over the whole pool) do not.
    contiguous_runs = [(m.BlockRun(0, num_blocks),)] * 4
    contiguous_data = [(source_pool[i * num_blocks:(i + 1) * num_blocks],) for i in range(4)]
    scattered_runs = tuple(m.BlockRun(2 * i, 1) for i in range(num_blocks))
    scattered_data = tuple(source_pool[b:b + 1] for b in scattered_ids)

    packer = KVPacker(HostStaging(allocate=transport.shared_host_buffer))  # as a daemon's mover keeps one
    packer.prepare(source_pool)
    gathered_move = (packer, source_pool, scattered_ids, list(range(num_blocks)))
    pulled = await transport.map_device_pool(server, source_pool)
    # Where the peer maps the pool, the daemons' path above pulls the rows; the gather over UCX
    # is then measured as well, with a packer that does not offer pools.
    ucx_packer = KVPacker(HostStaging(allocate=transport.shared_host_buffer), map_pools=False)
    ucx_packer.prepare(source_pool)

    num_messages = max(8, min(200, (512 * MiB) // (num_blocks * block_nbytes)))
    cases = {"contiguous": (contiguous_runs, contiguous_data, None), "gathered": ([None], [None], gathered_move),
             "gathered_over_ucx": ([None], [None], (ucx_packer, *gathered_move[1:])),
             "scattered": ([scattered_runs], [scattered_data], None)}
    alternated = ("contiguous", "gathered", "gathered_over_ucx") if pulled else ("contiguous", "gathered")
    targets = {}
    if pulled and eager_server is not None and await transport.map_device_pool(eager_server, source_pool):
        cases["contiguous_eagerly"] = cases["contiguous"]
        cases["pulled_eagerly"] = ([None], [None], gathered_move)
        targets["contiguous_eagerly"] = targets["pulled_eagerly"] = eager_server
        alternated += ("contiguous_eagerly", "pulled_eagerly")

    async def rate(name: str) -> float:
        runs, data, packed_move = cases[name]
        seconds = await send_blocks(transport, server, runs, data, num_messages, window, packed_move, targets.get(name))
        return num_blocks * block_nbytes * num_messages / seconds

    for name, (runs, data, packed_move) in cases.items():
        await send_blocks(transport, server, runs, data, 4, window, packed_move, targets.get(name))
    # The contiguous anchor and the gathered batch alternate, each round in the other order,
    # and the figure is the median of the rounds' ratios: one pair at a time spread 0.5-1.1x
    # on the H200 with the same code, as the anchor itself wandered between 17 and 38 GB/s.
    rounds = []
    for i in range(block_batch_rounds):
        order = alternated if i % 2 == 0 else tuple(reversed(alternated))
        rates = {name: await rate(name) for name in order}
        rounds.append(rates)
    ratios = [r["gathered"] / r["contiguous"] for r in rounds]
    middle = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    scattered = await rate("scattered")
    result = {"num_blocks": num_blocks, "block_nbytes": block_nbytes, "messages": num_messages,
              "window": window, "rounds": len(rounds), "pulled_from_mapped_pool": pulled,
              "contiguous_bytes_per_s": rounds[middle]["contiguous"],
              "gathered_bytes_per_s": rounds[middle]["gathered"],
              "scattered_bytes_per_s": scattered,
              "ratio": ratios[middle], "round_ratios": ratios,
              "scattered_destinations_ratio": scattered / rounds[middle]["contiguous"]}
    if pulled:
        over_ucx = [r["gathered_over_ucx"] / r["contiguous"] for r in rounds]
        result["gathered_over_ucx_round_ratios"] = over_ucx
        result["gathered_over_ucx_ratio"] = sorted(over_ucx)[len(over_ucx) // 2]
    if "pulled_eagerly" in targets:
        eager = [r["pulled_eagerly"] / r["contiguous_eagerly"] for r in rounds]
        result["pulled_eagerly_round_ratios"] = eager
        result["pulled_eagerly_ratio"] = sorted(eager)[len(eager) // 2]
    result["move_latency_window1"] = await move_latencies(transport, server, cases, alternated, targets=targets)
    return result


async def move_latencies(transport, server, cases: dict, names: tuple[str, ...], rounds: int = 4,
                         moves_per_round: int = 25, targets: dict | None = None) -> dict:
    """p50 and p90 of one move at a time (window 1), us, for each case, alternated over rounds:
    a batch's rate with several in flight hides where a move's time goes."""
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in (names if i % 2 == 0 else tuple(reversed(names))):
            runs, data, packed_move = cases[name]
            for _ in range(moves_per_round):
                t0 = time.perf_counter()
                await send_blocks(transport, server, runs, data, 1, 1, packed_move, (targets or {}).get(name))
                samples[name].append(time.perf_counter() - t0)
    return {name: {"p50_us": float(np.percentile(v, 50) * 1e6), "p90_us": float(np.percentile(v, 90) * 1e6)}
            for name, v in samples.items()}


def percentiles(samples: list[float]) -> dict:
    return {"p50_us": float(np.percentile(samples, 50) * 1e6),
            "p99_us": float(np.percentile(samples, 99) * 1e6)}


async def round_trip_samples(transport, server, device: str, nbytes: int, count: int) -> list[float]:
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    samples: list[float] = []
    for i in range(count + count // 10):
        t0 = time.perf_counter()
        await transport.request(server, m.Echo(payload), timeout_s=10)
        if i >= count // 10:
            samples.append(time.perf_counter() - t0)
    return samples


async def measure_round_trips(transport, server, device: str, count: int) -> dict:
    samples = await round_trip_samples(transport, server, device, PING_BYTES, count)
    return {"message_bytes": PING_BYTES, "count": count, "layer": percentiles(samples)}


async def measure_staging(device: str, count: int, spin_s: float) -> list[dict]:
    """Round trips of device buffers of several sizes, staged through the host (the default
    limit) against sent GPU-to-GPU by UCX (limit 0): where the default limit should lie."""
    rows = []
    for limit in (None, 0):
        server_process, port = start_process(["--role", "server", "--device", device, "--spin-s", str(spin_s),
                                              "--inline-cuda-limit", str(-1 if limit is None else limit)])
        transport = UcxTransport(TransportConfig(receive_device=device, request_timeout_s=60, spin_s=spin_s,
                                                 limits=limits_with(limit)))
        try:
            await transport.start(lambda message: asyncio.sleep(0))
            server = PeerAddress("127.0.0.1", port)
            for nbytes in STAGING_SIZES:
                samples = await round_trip_samples(transport, server, device, nbytes, count)
                rows.append({"message_bytes": nbytes, "staged": limit is None and nbytes <= FrameLimits().inline_cuda_limit_bytes,
                             "inline_cuda_limit_bytes": FrameLimits().inline_cuda_limit_bytes if limit is None else 0,
                             **percentiles(samples)})
        finally:
            await transport.close()
            server_process.kill()
            server_process.wait(timeout=10)
    return rows


def start_process(role_args: list[str]) -> tuple[subprocess.Popen, int]:
    """Start this script in another role; it prints "PORT <n>" once it listens."""
    process = subprocess.Popen([sys.executable, __file__, *role_args],
                               stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([process.stdout], [], [], 60)
    if not ready:
        process.kill()
        raise RuntimeError(f"benchmark process {role_args} did not start")
    return process, int(process.stdout.readline().split()[1])


async def run_client(args) -> dict:
    device = args.device
    # The copy anchors run before any server starts, so that no polling slows them.
    copy_rates = {nbytes: copy_bandwidth(nbytes, device, repeats=20) for nbytes in MESSAGE_SIZES}
    bare = measure_bare(args)
    server_process, layer_port = start_process(["--role", "server", "--device", device, "--spin-s", str(args.spin_s),
                                                "--copy-threads", str(args.copy_threads)])
    try:
        server = PeerAddress("127.0.0.1", layer_port)
        # First the layer with shared memory off: every buffer over UCX.
        over_ucx = UcxTransport(TransportConfig(receive_device=device, request_timeout_s=60, frame_timeout_s=60,
                                                spin_s=args.spin_s, shared_memory_bytes=0, header_ring_bytes=0))
        await over_ucx.start(lambda message: asyncio.sleep(0))
        ucx_rates = {nbytes: (await measure_bandwidth(over_ucx, server, device, nbytes, args.window))["bytes_per_s"]
                     for nbytes in MESSAGE_SIZES}
        # The round trip with the headers over UCX too (no header ring offered).
        ucx_round_trips = await measure_round_trips(over_ucx, server, device, args.round_trips)
        await over_ucx.close()
        transport = UcxTransport(TransportConfig(receive_device=device, request_timeout_s=60,
                                                 frame_timeout_s=60, spin_s=args.spin_s,
                                                 shared_memory_copy_threads=args.copy_threads))
        await transport.start(lambda message: asyncio.sleep(0))
        await transport.connect(server)
        shared_memory = transport.uses_shared_memory(server)
        bandwidth = []
        for nbytes in MESSAGE_SIZES:
            row = await measure_bandwidth(transport, server, device, nbytes, args.window)
            row["shared_memory"] = shared_memory and device == "cpu"
            if row["shared_memory"]:
                row["shared_sources_bytes_per_s"] = (await measure_bandwidth(
                    transport, server, device, nbytes, args.window, shared_sources=True))["bytes_per_s"]
                row["shared_sources_ratio"] = row["shared_sources_bytes_per_s"] / copy_rates[nbytes]
            row["over_ucx_bytes_per_s"] = ucx_rates[nbytes]
            row["over_ucx_ratio"] = ucx_rates[nbytes] / copy_rates[nbytes]
            row["copy_bytes_per_s"] = copy_rates[nbytes]
            row["bare_ucxx_bytes_per_s"] = bare["bandwidth"][nbytes]
            row["ratio"] = row["bytes_per_s"] / row["copy_bytes_per_s"]
            row["bare_ratio"] = row["bare_ucxx_bytes_per_s"] / row["copy_bytes_per_s"]
            row["ratio_to_bare"] = row["bytes_per_s"] / row["bare_ucxx_bytes_per_s"]
            bandwidth.append(row)
        batch_processes = []
        batch_server, eager_server = server, None
        if device.startswith("cuda"):
            # On a GPU, on two fresh servers started together: one that replays captured pulls
            # (the default), one that launches them eagerly. A server that has received the
            # bandwidth figures' messages took moves more slowly than a fresh one, by more than
            # the difference measured here.
            for pull_graphs in ("on", "off"):
                batch_processes.append(start_process(["--role", "server", "--device", device, "--spin-s",
                                                      str(args.spin_s), "--pull-graphs", pull_graphs]))
            batch_server, eager_server = (PeerAddress("127.0.0.1", port) for _process, port in batch_processes)
        try:
            batch = await measure_block_batch(transport, batch_server, device, args.num_blocks,
                                              args.block_nbytes, args.window, eager_server=eager_server)
        finally:
            for process, _port in batch_processes:
                process.kill()
                process.wait(timeout=10)
        round_trips = await measure_round_trips(transport, server, device, args.round_trips)
        await transport.close()
    finally:
        server_process.kill()
        server_process.wait(timeout=10)
    if device.startswith("cuda"):
        round_trips["staging"] = await measure_staging(device, max(200, args.round_trips // 5), args.spin_s)
    round_trips["layer_headers_over_ucx"] = ucx_round_trips["layer"]
    round_trips["bare_ucxx"] = bare["round_trip"]
    round_trips["overhead_p50"] = (round_trips["layer"]["p50_us"]
                                   / round_trips["bare_ucxx"]["p50_us"])
    return {"bandwidth": bandwidth, "block_batch": batch, "round_trip": round_trips}


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name().lower().replace("nvidia ", "").replace(" ", "-")
    return "cpu"


def print_table(results: dict) -> None:
    print(f"\n{'message':>10} {'transport GB/s':>15} {'bare GB/s':>10} {'copy GB/s':>10} "
          f"{'/copy':>6} {'bare/copy':>9} {'/bare':>6}")
    for row in results["bandwidth"]:
        print(f"{row['bytes'] // KiB:>7} KiB {row['bytes_per_s'] / 1e9:>15.2f} "
              f"{row['bare_ucxx_bytes_per_s'] / 1e9:>10.2f} "
              f"{row['copy_bytes_per_s'] / 1e9:>10.2f} {row['ratio']:>6.2f} "
              f"{row['bare_ratio']:>9.2f} {row['ratio_to_bare']:>6.2f}"
              f"   over UCX {row['over_ucx_ratio']:.2f}"
              + (f", sources in shared memory {row['shared_sources_ratio']:.2f}"
                 if "shared_sources_ratio" in row else ""))
    b = results["block_batch"]
    print(f"{b['num_blocks']} scattered blocks x {b['block_nbytes'] // KiB} KiB: gathered into one buffer "
          f"{b['gathered_bytes_per_s'] / 1e9:.2f} GB/s, already contiguous "
          f"{b['contiguous_bytes_per_s'] / 1e9:.2f} GB/s, ratio {b['ratio']:.2f} (median of "
          f"{', '.join(f'{r:.2f}' for r in b['round_ratios'])}); "
          f"into scattered destinations {b['scattered_destinations_ratio']:.2f}"
          + (f"; pulled from the mapped pool (gathered over UCX: {b['gathered_over_ucx_ratio']:.2f}, of "
             f"{', '.join(f'{r:.2f}' for r in b['gathered_over_ucx_round_ratios'])})"
             if b["pulled_from_mapped_pool"] else "")
          + (f"; pulled, launched eagerly (another server, its own anchor): {b['pulled_eagerly_ratio']:.2f}, of "
             f"{', '.join(f'{r:.2f}' for r in b['pulled_eagerly_round_ratios'])}" if "pulled_eagerly_ratio" in b else ""))
    print("one move at a time, p50: " + ", ".join(f"{name} {v['p50_us']:.1f} us"
                                                  for name, v in b["move_latency_window1"].items()))
    r = results["round_trip"]
    print(f"1 KiB round trip: layer p50 {r['layer']['p50_us']:.1f} us p99 "
          f"{r['layer']['p99_us']:.1f} us; bare ucxx p50 {r['bare_ucxx']['p50_us']:.1f} us "
          f"p99 {r['bare_ucxx']['p99_us']:.1f} us; overhead {r['overhead_p50']:.2f}x; "
          f"headers over UCX p50 {r['layer_headers_over_ucx']['p50_us']:.1f} us")
    for row in r.get("staging", []):
        print(f"device round trip {row['message_bytes'] // KiB:>5} KiB, staging limit "
              f"{row['inline_cuda_limit_bytes'] // KiB:>4} KiB: p50 {row['p50_us']:.1f} us p99 {row['p99_us']:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="client",
                        choices=["client", "server", "bare-server", "bare-client"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--port", type=int, default=0, help="(bare-client) the bare server's")
    parser.add_argument("--window", type=int, default=4, help="messages in flight")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-nbytes", type=int, default=64 * KiB)
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default=None,
                        help="event loop of every process (default: uvloop where installed)")
    parser.add_argument("--spin-s", type=float, default=None,
                        help="the transport's spin before a wait sleeps, s (default: the daemon's for the device, "
                             "20 ms on a GPU, 0.5 ms on the CPU)")
    parser.add_argument("--copy-threads", type=int, default=0,
                        help="threads a copy into or out of shared memory uses (both processes); 0: the default")
    parser.add_argument("--pull-graphs", choices=["on", "off"], default="on",
                        help="(server) rows pulled into its pool replayed from captured graphs, or launched eagerly")
    parser.add_argument("--inline-cuda-limit", type=int, default=-1,
                        help="(server) device bytes staged through the host; -1: the default")
    args = parser.parse_args()
    args.spin_s = peer_spin_for(args.spin_s, "cuda" if args.device.startswith("cuda") else "cpu")
    if args.loop:
        os.environ["INFLLM_BENCH_LOOP"] = args.loop
    torch.set_num_threads(1)  # one core per process: two processes share the host
    if args.role == "server":
        run_loop(serve(args.device, args.spin_s, None if args.inline_cuda_limit < 0 else args.inline_cuda_limit,
                       args.copy_threads, args.pull_graphs == "on"))
        return
    if args.role == "bare-server":
        run_loop(serve_bare(args.device))
        return
    if args.role == "bare-client":
        print(json.dumps(run_loop(run_bare_client(args, args.port))), flush=True)
        return
    results = run_loop(run_client(args))
    name = machine_name(args.device)
    report = {
        "machine": name, "device": args.device, "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "ucxx": ucxx.__version__, "ucx": ".".join(map(str, ucxx.get_ucx_version())),
        "UCX_TLS": os.environ.get("UCX_TLS", "(UCX default)"), "ucx_context_options": UCX_CONTEXT_OPTIONS,
        "layer_spin_s": args.spin_s, "bare_progress_mode": "polling",
        "shared_memory_copy_threads": args.copy_threads or default_copy_threads(),
        "event_loop": event_loop_name(),
        "window": args.window, **results,
    }
    suffix = "-asyncio" if args.loop == "asyncio" else ""
    out = args.out or Path(__file__).parent / "results" / f"transport-{name}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    print_table(results)


if __name__ == "__main__":
    main()
