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
    def num_home_blocks_kept_for_others(self) -> int:
        """Free home blocks that other homes' starting requests count on: not this home's to
        start a request on."""
        ...

    def blocks_kept_elsewhere(self, request_id: str, wanted: int) -> int:
        """Blocks the peers keep for a waiting request, which starts only when they cover what
        the home lacks; when fewer than ``wanted``, the peers are asked for that many (the
        answer comes at a later step)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is gone: the peers keep nothing more for it."""
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
