"""Decode attention of one long request spread over P GPUs: DistAttention against ring and
head-parallel attention, in one harness.

One process per GPU (rank r drives ``cuda:r``). Llama-3-8B attention shapes (32 query heads,
8 KV heads, head dim 128, bf16); one request of N tokens; each "step" attends over 32 layers in
sequence (``--layers`` distinct layers of KV, cycled, so no layer's KV is warm in L2 when it is
read again). Methods, all exact and checked against one another:

- ``distattention_ucx``: what ``infinited`` does. Rank 0 is the home and holds N/P tokens;
  every other rank is a creditor holding N/P older tokens in its pool, in a ``CreditorLedger``
  segment. Per layer the home sends an ``AttendRequest`` (the query, 8 KiB) to each creditor
  over the UCX transport (``request_soon``), computes its own MicroAttention meanwhile, awaits
  the creditors' ``AttendResult`` (partial output and log-sum-exp) and merges. The creditors
  serve with ``CreditorAttention``, the daemon's own handler.
- ``distattention_nccl``: the same placement and merge, with the query broadcast and the
  partial results gathered through NCCL: the algorithm without this project's transport.
- ``ring``: RingAttention-style decode. Every rank holds N/P tokens; the KV shards rotate
  around the ring (P - 1 rounds of NCCL send/recv, overlapped with the home's attention over
  the shard in hand), so the home sees every token.
- ``head_parallel``: every rank holds all N tokens for 8/P KV heads (and their query heads),
  attends locally and the outputs are all-gathered to the home (what a tensor-parallel
  instance does; the o_proj all-reduce that follows belongs to the dense layers and is not
  counted).
- ``one_gpu``: all N tokens on the home alone, the anchor of what the split saves.

Usage::

    python bench/distattention_multigpu.py                       # every GPU, P = 2, 4, 8 <= GPUs
    python bench/distattention_multigpu.py --contexts 32768,262144 --parts 2
    python bench/distattention_multigpu.py --device cpu --world 2 --contexts 2048 --steps 1
        # smoke run on the CPU: gloo and UCX over TCP, tiny shapes

Writes ``bench/results/distattention_multigpu-<gpu>-x<world>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from infinite_llm.bench.workers import add_worker_arguments, run_workers  # noqa: E402  (before torch)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from infinite_llm.kernels import merge_attention_states, plan_micro_attention, run_micro_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
LAYERS_PER_STEP = 32
HOME = 0
REQ_ID = 1


@dataclass(frozen=True)
class Args:
    device: str
    world: int
    rank: int
    contexts: list[int]
    parts: list[int]
    layers: int
    steps: int
    block_size: int
    dtype: torch.dtype
    port: int
    out: str
    with_one_gpu: bool  # time the home alone over all N tokens (it then holds them all)
    ucx_variants: list[tuple[int, float]]  # (staging limit, spin s) per UCX run; the first is reported
    profile_dir: str  # where each rank writes a cProfile of its UCX runs; "" for none


# --- KV of the request -----------------------------------------------------------------------


def layer_kv(args: Args, device: torch.device, context: int, layer: int) -> torch.Tensor:
    """The request's K and V of one layer, the same on every rank: ``[2, context, kv_heads, head_dim]``."""
    generator = torch.Generator(device=device).manual_seed(1000 + layer)
    return torch.randn(2, context, NUM_KV_HEADS, HEAD_DIM, generator=generator, device=device, dtype=args.dtype)


def query(args: Args, device: torch.device, layer: int) -> torch.Tensor:
    """The step's query of one layer, ``[1, num_heads, head_dim]``."""
    generator = torch.Generator(device=device).manual_seed(7 + layer)
    return torch.randn(1, NUM_HEADS, HEAD_DIM, generator=generator, device=device, dtype=args.dtype)


def to_pool(kv: torch.Tensor, pool: torch.Tensor, layer: int, block_size: int) -> None:
    """Write ``kv [2, tokens, heads, head_dim]`` into blocks 0.. of ``pool [blocks, layers, 2,
    block_size, heads, head_dim]`` at ``layer``."""
    tokens = kv.shape[1]
    num_blocks = tokens // block_size
    pool[:num_blocks, layer] = kv.view(2, num_blocks, block_size, *kv.shape[2:]).transpose(0, 1)


def new_pool(args: Args, device: torch.device, tokens: int, kv_heads: int) -> torch.Tensor:
    return torch.empty(tokens // args.block_size, args.layers, 2, args.block_size, kv_heads, HEAD_DIM,
                       dtype=args.dtype, device=device)


def full_plan(args: Args, pool: torch.Tensor, tokens: int, num_heads: int):
    """Decode plan over blocks 0.. of ``pool`` holding ``tokens`` keys, no causal mask."""
    device = pool.device
    num_blocks = tokens // args.block_size
    return plan_micro_attention(
        torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, -1),
        torch.tensor([tokens], dtype=torch.int32, device=device),
        torch.tensor([0, 1], dtype=torch.int32, device=device),
        num_heads=num_heads, num_kv_heads=pool.shape[4], head_dim=HEAD_DIM, block_size=args.block_size,
        num_blocks=pool.shape[0], max_query_len=1, max_kv_len=tokens, check_bounds=False,
    )


# --- timing ------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_layer_seconds(run_steps, device: torch.device, steps: int) -> float:
    """Seconds per layer: one warm-up step, then ``steps`` steps of 32 layers, timed whole."""
    run_steps(1)
    sync(device)
    started = time.perf_counter()
    run_steps(steps)
    sync(device)
    return (time.perf_counter() - started) / (steps * LAYERS_PER_STEP)


# --- the methods -------------------------------------------------------------------------------


class Shards:
    """What one rank holds for one (P, context) case."""

    def __init__(self, args: Args, device: torch.device, context: int, parts: int) -> None:
        rank = args.rank
        self.tokens = context // parts  # per rank, token-sharded
        self.token_pool = new_pool(args, device, self.tokens, NUM_KV_HEADS)
        heads = NUM_KV_HEADS // parts
        self.head_pool = new_pool(args, device, context, heads)
        self.full_pool = new_pool(args, device, context, NUM_KV_HEADS) if rank == HOME and args.with_one_gpu else None
        for layer in range(args.layers):
            kv = layer_kv(args, device, context, layer)
            to_pool(kv[:, rank * self.tokens:(rank + 1) * self.tokens], self.token_pool, layer, args.block_size)
            to_pool(kv[:, :, rank * heads:(rank + 1) * heads].contiguous(), self.head_pool, layer, args.block_size)
            if self.full_pool is not None:
                to_pool(kv, self.full_pool, layer, args.block_size)
            del kv
        self.queries = [query(args, device, layer) for layer in range(args.layers)]


def run_one_gpu(args: Args, shards: Shards, context: int) -> tuple[float, torch.Tensor]:
    plan = full_plan(args, shards.full_pool, context, NUM_HEADS)

    def layer_out(layer: int) -> torch.Tensor:
        return run_micro_attention(plan, shards.queries[layer], shards.full_pool, layer, out_dtype=args.dtype,
                                   return_lse=False).out

    def steps(n: int) -> None:
        for i in range(n * LAYERS_PER_STEP):
            layer_out(i % args.layers)
    seconds = per_layer_seconds(steps, shards.full_pool.device, args.steps)
    return seconds, final_output(args, layer_out)


def final_output(args: Args, attend) -> torch.Tensor | None:
    """The output of the last layer of a step, float32, for the cross-check (None off the home)."""
    out = attend((LAYERS_PER_STEP - 1) % args.layers)
    return None if out is None else out.float()


def run_head_parallel(args: Args, shards: Shards, context: int, group, parts: int) -> tuple[float, torch.Tensor | None]:
    heads = NUM_HEADS // parts
    rank = args.rank
    plan = full_plan(args, shards.head_pool, context, heads)
    gathered = [torch.empty(1, heads, HEAD_DIM, dtype=args.dtype, device=shards.head_pool.device) for _ in range(parts)]
    local_q = [q[:, rank * heads:(rank + 1) * heads].contiguous() for q in shards.queries]

    def layer_out(layer: int) -> torch.Tensor:
        part = run_micro_attention(plan, local_q[layer], shards.head_pool, layer, out_dtype=args.dtype,
                                   return_lse=False).out
        dist.all_gather(gathered, part, group=group)
        return torch.cat(gathered, dim=1)

    def steps(n: int) -> None:
        for i in range(n * LAYERS_PER_STEP):
            layer_out(i % args.layers)
    seconds = per_layer_seconds(steps, shards.head_pool.device, args.steps)
    return seconds, final_output(args, layer_out)


def run_distattention_nccl(args: Args, shards: Shards, group, parts: int) -> tuple[float, torch.Tensor | None]:
    device = shards.token_pool.device
    plan = full_plan(args, shards.token_pool, shards.tokens, NUM_HEADS)
    q_in = torch.empty(1, NUM_HEADS, HEAD_DIM, dtype=args.dtype, device=device)
    # out and lse travel as one float32 tensor [1, heads, head_dim + 1]: one collective.
    parts_buf = [torch.empty(1, NUM_HEADS, HEAD_DIM + 1, dtype=torch.float32, device=device) for _ in range(parts)]

    def layer_out(layer: int) -> torch.Tensor:
        if args.rank == HOME:
            q_in.copy_(shards.queries[layer])
        dist.broadcast(q_in, HOME, group=group)
        state = run_micro_attention(plan, q_in, shards.token_pool, layer, out_dtype=torch.float32)
        dist.all_gather(parts_buf, torch.cat([state.out, state.lse.unsqueeze(-1)], dim=-1), group=group)
        stacked = torch.stack(parts_buf)
        return merge_attention_states(stacked[..., :HEAD_DIM], stacked[..., HEAD_DIM], out_dtype=args.dtype).out

    def steps(n: int) -> None:
        for i in range(n * LAYERS_PER_STEP):
            layer_out(i % args.layers)
    seconds = per_layer_seconds(steps, device, args.steps)
    return seconds, final_output(args, layer_out)


def run_ring(args: Args, shards: Shards, group, parts: int) -> tuple[float, torch.Tensor | None]:
    """KV shards rotate: in round j the home attends over the shard of rank (home - j) mod P
    while the next one arrives. Each layer's shard is a single-layer pool, sent whole."""
    device = shards.token_pool.device
    rank = args.rank
    ranks = list(range(parts))
    send_to, recv_from = ranks[(rank + 1) % parts], ranks[(rank - 1) % parts]
    layer_pools = [shards.token_pool[:, layer:layer + 1].contiguous() for layer in range(args.layers)]
    spare = [torch.empty_like(layer_pools[0]) for _ in range(2)]
    plan = full_plan(args, layer_pools[0], shards.tokens, NUM_HEADS)

    def layer_out(layer: int) -> torch.Tensor | None:
        held = layer_pools[layer]
        outs, lses = [], []
        for round_ in range(parts):
            pending = []
            if round_ < parts - 1:
                incoming = spare[round_ % 2]
                pending = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, held, send_to, group=group),
                    dist.P2POp(dist.irecv, incoming, recv_from, group=group),
                ])
            if rank == HOME:
                state = run_micro_attention(plan, shards.queries[layer], held, 0, out_dtype=torch.float32)
                outs.append(state.out)
                lses.append(state.lse)
            for work in pending:
                work.wait()
            if pending:
                held = incoming
        if rank != HOME:
            return None
        return merge_attention_states(torch.stack(outs), torch.stack(lses), out_dtype=args.dtype).out

    def steps(n: int) -> None:
        for i in range(n * LAYERS_PER_STEP):
            layer_out(i % args.layers)
    seconds = per_layer_seconds(steps, device, args.steps)
    return seconds, final_output(args, layer_out)


async def run_distattention_ucx(args: Args, shards: Shards, addresses: list, transport,
                                parts: int) -> tuple[float, torch.Tensor]:
    """The home's side; creditors serve through ``served`` in the transport's handler."""
    from infinite_llm.transport.messages import AttendRequest, AttendSlice

    device = shards.token_pool.device
    creditors = list(range(1, parts))
    step_ids = iter(range(1, 1 << 30))

    async def step(outputs: list | None = None) -> None:
        step_id = next(step_ids)
        plan = full_plan(args, shards.token_pool, shards.tokens, NUM_HEADS)  # once per step, as the engine
        for i in range(LAYERS_PER_STEP):
            layer = i % args.layers
            q = shards.queries[layer]
            replies = [transport.request_soon(addresses[r], AttendRequest(
                HOME, r, step_id, layer, (AttendSlice(REQ_ID, 0, 1, r, shards.tokens),), q)) for r in creditors]
            local = run_micro_attention(plan, q, shards.token_pool, layer, out_dtype=torch.float32)
            outs, lses = [local.out], [local.lse]
            for reply in replies:
                result = await reply
                outs.append(torch.as_tensor(result.out, device=device))
                lses.append(torch.as_tensor(result.lse, device=device))
            merged = merge_attention_states(torch.stack(outs), torch.stack(lses), out_dtype=args.dtype).out
            if outputs is not None:
                outputs.append(merged)

    await step()
    sync(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        await step()
    sync(device)
    seconds = (time.perf_counter() - started) / (args.steps * LAYERS_PER_STEP)
    outputs: list = []
    await step(outputs)
    return seconds, outputs[-1].float()


class ServedShard:
    """A creditor's held segment of the home's request, served by the daemon's handler."""

    def __init__(self, shards: Shards, rank: int) -> None:
        from infinite_llm.daemon.creditor import CreditorAttention
        from infinite_llm.daemon.ledger import CreditorLedger

        pool = shards.token_pool
        free = list(range(pool.shape[0]))
        ledger = CreditorLedger(allocate=lambda n: [free.pop(0) for _ in range(n)] if n <= len(free) else None,
                                free=lambda ids: free.extend(ids), reservation_ttl_s=60.0)
        reservation = ledger.reserve(HOME, REQ_ID, pool.shape[0], now=0.0)
        ledger.commit(reservation.reservation_id, HOME, REQ_ID, rank, now=0.0)
        self.attention = CreditorAttention(ledger, pool, NUM_HEADS)


def nccl_latency(device: torch.device, group, parts: int, repeats: int = 200) -> dict:
    """Anchors of the NCCL methods' communication in the same run: a broadcast of one query
    (8 KiB in bf16) and an all-gather of one partial result, microseconds each."""
    q = torch.zeros(1, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    part = torch.zeros(1, NUM_HEADS, HEAD_DIM + 1, dtype=torch.float32, device=device)
    gathered = [torch.empty_like(part) for _ in range(parts)]
    result = {}
    for name, op in (("nccl_broadcast_8k_us", lambda: dist.broadcast(q, HOME, group=group)),
                     ("nccl_all_gather_16k_us", lambda: dist.all_gather(gathered, part, group=group))):
        op()
        dist.barrier(group=group)
        sync(device)
        started = time.perf_counter()
        for _ in range(repeats):
            op()
        sync(device)
        result[name] = (time.perf_counter() - started) / repeats * 1e6
    return result


# --- one rank ----------------------------------------------------------------------------------


async def ucx_case(args: Args, shards: Shards, parts: int, transport, addresses: list, holder: dict):
    """Run the UCX method; creditors wait for the home's "done" echo."""
    from infinite_llm.transport import messages as m

    served = ServedShard(shards, args.rank) if args.rank != HOME else None
    holder["served"] = served
    holder["done"] = asyncio.Event()
    result = None
    if args.rank == HOME:
        result = await run_distattention_ucx(args, shards, addresses, transport, parts)
        for r in range(1, parts):
            await transport.request(addresses[r], m.Echo(torch.zeros(1, dtype=torch.uint8)))
    elif args.rank < parts:
        await asyncio.wait_for(holder["done"].wait(), timeout=600)
    holder["served"] = None
    return result


def worker(args: Args) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(args.rank)
        device = torch.device("cuda", args.rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, device_id=device if device.type == "cuda" else None)
    groups = {p: dist.new_group(list(range(p))) for p in args.parts}
    asyncio.run(worker_main(args, device, groups))
    dist.barrier()
    dist.destroy_process_group()


async def worker_main(args: Args, device: torch.device, groups: dict) -> None:
    from infinite_llm.transport import messages as m
    from infinite_llm.transport.codec import FrameLimits
    from infinite_llm.transport.interface import PeerAddress, TransportConfig
    from infinite_llm.transport.ucx import UcxTransport

    holder: dict = {"served": None, "done": None}

    def handle(message: m.Message) -> m.Message | None:
        if isinstance(message, m.AttendRequest):
            return holder["served"].attention.attend(message)
        if isinstance(message, m.Echo):
            holder["done"].set()
            return m.EchoReply(message.payload)
        return None

    # One transport per variant: staging limit (device buffers up to it travel inline through
    # the host) and spin (how long a wait polls UCX before it sleeps).
    transports = {}
    for limit, spin_s in args.ucx_variants:
        transport = UcxTransport(TransportConfig(
            host="127.0.0.1", request_timeout_s=60.0, frame_timeout_s=60.0, receive_device=str(device),
            spin_s=spin_s, limits=FrameLimits(inline_cuda_limit_bytes=limit)))
        await transport.start(handle)
        gathered: list = [None] * args.world
        dist.all_gather_object(gathered, (transport.address.host, transport.address.port))
        transports[(limit, spin_s)] = (transport, [PeerAddress(h, p) for h, p in gathered])

    # cProfile of the UCX method alone, every rank (--profile-dir).
    profile = cProfile.Profile() if args.profile_dir else None
    rows = []
    for parts in args.parts:
        group = groups[parts]
        for context in args.contexts:
            if args.rank >= parts:
                dist.barrier()
                continue
            shards = Shards(args, device, context, parts)
            sync(device)
            case: dict = {"parts": parts, "context": context, **nccl_latency(device, group, parts)}
            outputs = {}
            if args.rank == HOME and args.with_one_gpu:
                seconds, out = run_one_gpu(args, shards, context)
                case["one_gpu_us"], outputs["one_gpu"] = seconds * 1e6, out
            dist.barrier(group=group)
            seconds, out = run_head_parallel(args, shards, context, group, parts)
            case["head_parallel_us"], outputs["head_parallel"] = seconds * 1e6, out
            dist.barrier(group=group)
            seconds, out = run_ring(args, shards, group, parts)
            case["ring_us"], outputs["ring"] = seconds * 1e6, out
            dist.barrier(group=group)
            seconds, out = run_distattention_nccl(args, shards, group, parts)
            case["distattention_nccl_us"], outputs["distattention_nccl"] = seconds * 1e6, out
            dist.barrier(group=group)
            for (limit, spin_s), (transport, addresses) in transports.items():
                transport.set_spin(spin_s)  # loop-wide: the creditors' waits spin as long
                if profile is not None:
                    profile.enable()
                result = await ucx_case(args, shards, parts, transport, addresses, holder)
                if profile is not None:
                    profile.disable()
                if result is not None:
                    suffix = "" if (limit, spin_s) == args.ucx_variants[0] else f"_inline{limit // 1024}k_spin{spin_s * 1e6:.0f}us"
                    case[f"distattention_ucx{suffix}_us"], outputs[f"distattention_ucx{suffix}"] = result[0] * 1e6, result[1]
                dist.barrier(group=group)
            if args.rank == HOME:
                reference = outputs["head_parallel"]
                case["max_abs_diff"] = {name: float((o - reference).abs().max()) for name, o in outputs.items()}
                rows.append(case)
                print(json.dumps(case), flush=True)
            del shards
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    for transport, _ in transports.values():
        await transport.close()
    if profile is not None:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(args.profile_dir) / f"ucx-rank{args.rank}.prof")
    if args.rank == HOME:
        Path(args.out).write_text(json.dumps(rows))


# --- the launcher ------------------------------------------------------------------------------


def summarize(rows: list[dict], meta: dict) -> dict:
    for row in rows:
        row["per_step_ms"] = {k.removesuffix("_us"): v * LAYERS_PER_STEP / 1e3 for k, v in row.items() if k.endswith("_us")}
        dist_ucx = row.get("distattention_ucx_us")
        dist_nccl = row["distattention_nccl_us"]
        row["ratios"] = {
            # > 1: DistAttention is that many times faster.
            "ring_over_distattention_ucx": row["ring_us"] / dist_ucx if dist_ucx else None,
            "ring_over_distattention_nccl": row["ring_us"] / dist_nccl,
            "head_parallel_over_distattention_ucx": row["head_parallel_us"] / dist_ucx if dist_ucx else None,
            "head_parallel_over_distattention_nccl": row["head_parallel_us"] / dist_nccl,
        }
        if "one_gpu_us" in row:
            row["ratios"]["one_gpu_over_distattention_nccl"] = row["one_gpu_us"] / dist_nccl
    return {**meta, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=0, help="processes (GPUs); default every GPU")
    parser.add_argument("--contexts", default="32768,131072,262144,1048576")
    parser.add_argument("--parts", default="", help="P values; default 2, 4, 8 up to --world")
    parser.add_argument("--layers", type=int, default=4, help="distinct layers of KV, cycled over a step of 32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps of 32 layers per method")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-one-gpu", action="store_true", help="skip the one-GPU anchor (it holds all KV)")
    parser.add_argument("--inline-cuda-limits", default="8192",
                        help="device bytes a frame stages through the host; the UCX method runs once per value, "
                             "the first is the transport's default")
    parser.add_argument("--spin-s", default="0.0005",
                        help="UCX spin before a wait sleeps, s; the UCX method runs once per value (and limit)")
    parser.add_argument("--profile-dir", default="", help="write a cProfile of each rank's UCX runs here")
    parser.add_argument("--out", default="")
    add_worker_arguments(parser)
    ns = parser.parse_args()
    world = ns.world or (torch.cuda.device_count() if ns.device == "cuda" else 2)
    parts = [int(p) for p in ns.parts.split(",")] if ns.parts else [p for p in (2, 4, 8) if p <= world]
    contexts = [int(c) for c in ns.contexts.split(",")]
    if not parts or any(p < 2 or p > world or NUM_KV_HEADS % p for p in parts):
        sys.exit(f"--parts must be 2, 4 or 8 and at most --world ({world}); got {parts}")
    for c in contexts:
        for p in parts:
            if c % (p * ns.block_size):
                sys.exit(f"context {c} is not a multiple of P * block size ({p} * {ns.block_size})")
    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    variants = [(int(limit), float(spin)) for limit in ns.inline_cuda_limits.split(",") for spin in ns.spin_s.split(",")]

    if ns.worker_rank >= 0:
        worker(Args(ns.device, world, ns.worker_rank, contexts, parts, ns.layers, ns.steps, ns.block_size, dtype,
                    ns.port, ns.rows_out, with_one_gpu=not ns.no_one_gpu, ucx_variants=variants,
                    profile_dir=ns.profile_dir))
        return

    rows = run_workers(__file__, world)
    name = torch.cuda.get_device_name(0).replace(" ", "-") if ns.device == "cuda" else "cpu"
    meta = {
        "bench": "distattention_multigpu",
        "device": name,
        "world": world,
        "host": platform.node(),
        "torch": torch.__version__,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": str(dtype).removeprefix("torch."), "block_size": ns.block_size,
                  "distinct_layers": ns.layers, "layers_per_step": LAYERS_PER_STEP},
        "steps": ns.steps,
        "unit": "microseconds per layer (mean); per_step_ms = 32 layers",
    }
    result = summarize(rows, meta)
    out = Path(ns.out or Path(__file__).parent / "results" / f"distattention_multigpu-{name}-x{world}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'P':>2} {'context':>8} {'one_gpu':>9} {'head_par':>9} {'ring':>9} {'dist_nccl':>9} {'dist_ucx':>9}   us/layer")
    for row in rows:
        cells = [row.get(k) for k in ("one_gpu_us", "head_parallel_us", "ring_us", "distattention_nccl_us",
                                      "distattention_ucx_us")]
        print(f"{row['parts']:>2} {row['context']:>8} " + " ".join(f"{c:9.1f}" if c else f"{'-':>9}" for c in cells))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
