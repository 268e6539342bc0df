"""The buffers of a KV move: one per destination run, gathered from the source pool.

A run whose source blocks are consecutive is a view of the pool (no copy); one whose sources
are scattered is gathered with one ``index_select`` on the pool's device, queued on the
current stream: the codec waits for it before UCX reads the buffer on its own streams.
"""

from __future__ import annotations

import torch

from infinite_llm.transport.block_runs import PackedRun, destination_runs
from infinite_llm.transport.messages import BlockRun


def pack_kv_runs(pool: torch.Tensor, src_block_ids: list[int] | tuple[int, ...],
                 dst_block_ids: list[int] | tuple[int, ...]) -> tuple[tuple[BlockRun, ...], tuple[torch.Tensor, ...]]:
    """``(runs, buffers)`` for a ``KVBlocks`` message moving ``src_block_ids`` of ``pool``
    (``[num_blocks, ...]``, one block per leading index) into ``dst_block_ids``.

    ``buffers[i]``: ``[runs[i].num_blocks, *pool.shape[1:]]``, the pool's dtype and device.
    """
    packed: list[PackedRun] = destination_runs(src_block_ids, dst_block_ids)
    buffers = []
    for run in packed:
        if run.src_consecutive:
            first = run.src_block_ids[0]
            buffers.append(pool[first:first + run.num_blocks])
        else:
            index = torch.tensor(run.src_block_ids, dtype=torch.long, device=pool.device)
            buffers.append(pool.index_select(0, index))
    return tuple(BlockRun(r.dst_block_id, r.num_blocks) for r in packed), tuple(buffers)
