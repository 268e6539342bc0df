"""The KV pool: one tensor holding every block of one instance.

Layout: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.

One block is one contiguous span across all layers (K then V per layer), so moving N blocks
between instances is N buffers, or fewer when the block ids are consecutive. Within one
(block, layer, K|V) the tokens are rows of ``num_kv_heads * head_dim`` elements, so the
attention kernels read ``head_dim`` contiguous elements per token and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_POOL_DIMS = 6


@dataclass(frozen=True)
class KVPoolShape:
    """The shape of a KV pool; sizes in elements unless named otherwise."""

    num_blocks: int
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_blocks", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVPoolShape.{name} must be positive, got {getattr(self, name)}")

    @property
    def dims(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one block (all layers, K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def of(cls, kv_pool: torch.Tensor) -> "KVPoolShape":
        if kv_pool.dim() != KV_POOL_DIMS or kv_pool.shape[2] != 2:
            raise ValueError(
                "kv_pool must have shape [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got {tuple(kv_pool.shape)}"
            )
        num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_pool.shape
        return cls(num_blocks, num_layers, block_size, num_kv_heads, head_dim)


def allocate_kv_pool(
    shape: KVPoolShape, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Allocate a pool of ``shape.dims``. Uninitialised: every slot is written before it is read."""
    return torch.empty(shape.dims, dtype=dtype, device=device)
