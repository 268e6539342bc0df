"""The interface both transports (UCX and in-memory) implement, and their configuration."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from infinite_llm.transport.codec import FrameLimits
from infinite_llm.transport.messages import Message, WireArray


@dataclass(frozen=True, order=True)
class PeerAddress:
    host: str  # IP address of the peer's listener
    port: int  # its port

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


# Serves one incoming message. Returns the reply, or None where the message needs none (the
# sender then gets Ack if it asked for a reply), either at once or as an awaitable: a handler
# that answers at once is answered inline (lowest latency); an awaitable runs as its own task.
# Exceptions become ErrorReply(handler_failed).
MessageHandler = Callable[[Message], Message | None | Awaitable[Message | None]]

# Given a message whose tensor fields still hold TensorSpecs (the header), returns where its
# buffers go, one array per buffer in order, or None for fresh tensors. Raises
# PlacementRefused when the buffers have nowhere to go. Must not block: it runs between the
# header and the buffers of a frame.
BufferPlacer = Callable[[Message], Sequence[WireArray] | None]


@dataclass(frozen=True)
class TransportConfig:
    host: str = "127.0.0.1"  # where the listener binds
    port: int = 0  # 0: any free port
    connect_timeout_s: float = 1.0  # connecting to a peer (a dead port shows only as this), s
    request_timeout_s: float = 5.0  # default wait for a reply, s
    frame_timeout_s: float = 10.0  # sending a frame, or receiving its buffers, s
    idle_timeout_s: float = 300.0  # a connection with no traffic this long, and none in flight, is closed, s
    receive_device: str = "cpu"  # where received tensors are allocated: "cpu" or "cuda[:n]"
    # A frame whose buffers all travel inside its header lands in host memory even when
    # receive_device is a GPU: its bytes are on the host already, and landing them on the
    # device would copy on the current stream, behind whatever the receiver's own step has
    # queued there. The reader moves them to the device on a stream of its choosing.
    land_inline_on_host: bool = False
    # How long a UCX wait spins (progressing the worker, yielding to the event loop) before it
    # sleeps on the worker's event fd, s. A reply that is on its way comes within the spin
    # (lowest latency); an idle connection costs no CPU. 0: always sleep (~150 us more per
    # frame on loopback). The first transport of an event loop sets it for the loop.
    spin_s: float = 500e-6
    # Requests' host buffers to peers on this host go through a file in shared memory
    # (``shared_memory``); its size in bytes (sparse, committed as used). 0: over UCX.
    shared_memory_bytes: int = 1 << 30
    shared_memory_dir: str = "/dev/shm"  # where the file lies; peers must see the same
    # Threads that copy a large buffer into or out of shared memory; 0: a quarter of the
    # process's CPUs, at most 4.
    shared_memory_copy_threads: int = 0
    # Frame headers to and from peers on this host go through a ring in shared memory, one
    # per connection and direction (``header_ring``); its data size in bytes (committed at
    # once). 0, or a machine other than x86-64: over UCX.
    header_ring_bytes: int = 2 << 20
    # A move's KV blocks from a device pool go to a peer on this host as their row ids, and
    # the peer copies them out of the pool mapped through CUDA IPC (``device_pools``). False:
    # gathered and sent over UCX.
    device_pools: bool = True
    # Rows pulled into rows of a pool of this process go as one replay of a captured CUDA graph
    # (``device_pools.PullGraphs``). False: launched eagerly, as rows into other destinations.
    pull_graphs: bool = True
    limits: FrameLimits = field(default_factory=FrameLimits)

    def landing_device(self, all_inline: bool) -> str:
        """Where a frame's fresh destinations are allocated (``all_inline``: every buffer came
        inside its header)."""
        return "cpu" if self.land_inline_on_host and all_inline else self.receive_device


class Transport(Protocol):
    """Messages between instances. Connections are cached per peer and made again after a
    peer restarts; every wait is bounded; failures raise ``TransportError`` subclasses."""

    @property
    def address(self) -> PeerAddress:
        """Where peers reach this transport's listener (valid after ``start``)."""
        ...

    async def start(self, handler: MessageHandler, placer: BufferPlacer | None = None) -> None:
        """Start the listener; incoming messages go to ``handler``."""
        ...

    async def request(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None,
        device_ready: bool = False,
    ) -> Message:
        """Send ``message`` and return the reply. Raises PeerUnreachable, RequestTimeout or
        RemoteError (the peer answered ErrorReply).

        ``device_ready``: the caller has waited for the kernels that wrote the message's device
        tensors (an event it polled, ``kv_packing.wait_for_event``), so the transport does not
        wait for the current stream before UCX reads them (``codec.encode``)."""
        ...

    def request_soon(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None,
        device_ready: bool = False,
    ) -> Awaitable[Message]:
        """``request``, started now: where it can, the message leaves before this returns (the
        peer works on it while the caller computes). Await the result for the reply."""
        ...

    async def send(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None
    ) -> None:
        """Send ``message`` expecting no reply; returns once it has left."""
        ...

    def shared_host_buffer(self, nbytes: int) -> WireArray | None:
        """A flat uint8 host tensor of ``nbytes`` that requests to peers on this host carry with
        no copy (it lies in memory they map), or None where there is no such memory. Used
        again once no view of it is left."""
        ...

    async def map_device_pool(self, peer: PeerAddress, pool: WireArray, timeout_s: float | None = None) -> bool:
        """Whether ``peer`` reads rows of ``pool`` in place (``device_pools.PoolRows`` buffers
        travel as their ids), offering the pool on first use. False where it cannot: rows
        then travel gathered. Raises PeerUnreachable or RequestTimeout."""
        ...

    def shared_memory_status(self) -> dict:
        """The shared memory's figures: ``region`` (its file name, or None), ``committed_bytes``,
        ``in_use_bytes``, ``peers`` (the addresses that requests reach through it),
        ``header_ring_peers`` (those whose connections carry their headers through rings) and
        ``header_ring_inbound`` (connections from peers that do)."""
        ...

    async def connect(self, peer: PeerAddress) -> None:
        """Open the connection to ``peer`` now if there is none, so that no request waits for
        the handshake (which needs the peer's event loop to turn). Raises PeerUnreachable."""
        ...

    async def close(self) -> None:
        """Stop the listener and drop every connection; pending requests fail."""
        ...
