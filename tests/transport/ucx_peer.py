"""A peer process for the UCX tests: a real instance's transport, killable with SIGKILL.

    ucx_peer.py serve [PORT] [--cuda] [--no-device-pools]
                                    listen; print "PORT <n>"; answer Echo, KVBlocks, Drain and Ack
                                    (--cuda: the pool and the received tensors on the GPU;
                                    --no-device-pools: it maps no peer's device pool)
    ucx_peer.py flood HOST PORT     send large Echo requests to HOST:PORT until killed

``serve`` places KVBlocks for reservation 7 straight into a pool of its own, checks the bytes
there and answers KVBlocksStored; other reservations are refused. Drain sleeps drain_id ms.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import PlacementRefused, TransportError
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.ucx import UcxTransport

NUM_POOL_BLOCKS = 64
BLOCK_SHAPE = (2, 2, 16, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]


async def serve(port: int, device: str = "cpu", device_pools: bool = True) -> None:
    pool = torch.zeros((NUM_POOL_BLOCKS, *BLOCK_SHAPE), dtype=torch.float32, device=device)

    def place(message: m.Message):
        if not isinstance(message, m.KVBlocks):
            return None
        if message.reservation_id != 7:
            raise PlacementRefused(f"no reservation {message.reservation_id}")
        return [pool[r.dst_block_id:r.dst_block_id + r.num_blocks] for r in message.runs]

    async def handle(message: m.Message) -> m.Message | None:
        if isinstance(message, m.Echo):
            return m.EchoReply(message.payload)
        if isinstance(message, m.KVBlocks):
            # The sender fills block b with the value b + 1; check that it landed in the pool
            # itself (the tensors are views of the pool: no copy on the way in).
            for run, data in zip(message.runs, message.runs_data):
                in_pool = pool[run.dst_block_id:run.dst_block_id + run.num_blocks]
                if data.data_ptr() != in_pool.data_ptr():
                    raise ValueError("blocks were not received into the pool")
                for j in range(run.num_blocks):
                    if not bool((in_pool[j] == run.dst_block_id + j + 1).all()):
                        raise ValueError(f"block {run.dst_block_id + j} holds the wrong bytes")
            num_blocks = sum(r.num_blocks for r in message.runs)
            return m.KVBlocksStored(message.move_id, message.reservation_id, num_blocks)
        if isinstance(message, m.Ack):
            return None
        if isinstance(message, m.Drain):
            await asyncio.sleep(message.drain_id / 1000)  # a slow handler: drain_id ms
            return None
        raise ValueError(f"unexpected {message.TYPE}")

    transport = UcxTransport(TransportConfig(port=port, receive_device=device, device_pools=device_pools))
    await transport.start(handle, place)
    print(f"PORT {transport.address.port}", flush=True)
    await asyncio.sleep(3600)


async def flood(host: str, port: int) -> None:
    transport = UcxTransport(TransportConfig())
    payload = torch.ones(16 << 20, dtype=torch.uint8)
    print("FLOODING", flush=True)
    while True:
        try:
            await transport.request(PeerAddress(host, port), m.Echo(payload), timeout_s=5)
        except TransportError:
            await asyncio.sleep(0.01)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        numbers = [a for a in sys.argv[2:] if not a.startswith("--")]
        asyncio.run(serve(int(numbers[0]) if numbers else 0, "cuda" if "--cuda" in sys.argv else "cpu",
                          "--no-device-pools" not in sys.argv))
    else:
        asyncio.run(flood(sys.argv[2], int(sys.argv[3])))
