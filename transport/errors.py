"""What the transport raises. Every failure a caller can act on is a ``TransportError``."""

from __future__ import annotations

from infinite_llm.transport.messages import ErrorCode


class TransportError(Exception):
    """Base of every error the transport raises to its callers."""


class PeerUnreachable(TransportError):
    """The peer could not be reached, or its connection failed (killed, restarted, closed).

    The cached connection is gone; the next request to the peer connects afresh.
    """

    def __init__(self, peer: object, detail: str) -> None:
        super().__init__(f"{peer}: {detail}")
        self.peer = peer
        self.detail = detail


class RequestTimeout(TransportError):
    """No reply within the request's timeout. The peer may be silent, slow or partitioned."""

    def __init__(self, peer: object, message_type: str, timeout_s: float) -> None:
        super().__init__(f"{peer}: no reply to {message_type} within {timeout_s:.3f} s")
        self.peer = peer
        self.message_type = message_type
        self.timeout_s = timeout_s


class RemoteError(TransportError):
    """The peer answered with ``ErrorReply``."""

    def __init__(self, peer: object, code: ErrorCode, detail: str) -> None:
        super().__init__(f"{peer}: {code.value}: {detail}")
        self.peer = peer
        self.code = code
        self.detail = detail


class ProtocolError(TransportError):
    """A frame broke the protocol; the receiver refuses it and closes the connection."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail


class PlacementRefused(Exception):
    """Raised by a buffer placer that has nowhere to put a frame's buffers (for example, a
    ``KVBlocks`` for a reservation that expired). The sender gets ``ErrorReply``."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail
