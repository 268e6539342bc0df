"""The seam through which a daemon lends a request's KV blocks to peer instances.

In one process the engine copies blocks between its own pools. Across daemons the blocks move
over the transport in two phases (reserve on the peer, send, commit), which the daemon
implements behind this interface; the engine only says when and how much.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .block_manager import Segment

if TYPE_CHECKING:
    from .engine import LLMEngine


class KVLender(Protocol):
    def num_free_blocks_elsewhere(self) -> int:
        """Blocks the peers last published as free for others: a waiting request starts only when
        its context fits the home's free blocks and these."""
        ...

    def num_blocks_elsewhere(self) -> int:
        """Blocks of the peers' pools. Admission refuses only a request that the whole cluster
        could never hold; one that fits waits for memory, as it would for its home's."""
        ...

    async def spill(self, engine: LLMEngine, num_blocks: int) -> None:
        """Move old blocks of running requests off the home pool, aiming to free ``num_blocks``.

        Called at a step boundary; the engine's tables switch only for moves that committed.
        """
        ...

    def release(self, request_id: str, segment: Segment) -> None:
        """The request is gone: tell the peer holding ``segment`` to free it."""
        ...
