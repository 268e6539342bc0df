"""The bearer token of the gManager's admin API on TCP.

The admin API's Unix socket is guarded by its file mode and group; a TCP port is open to every
local user and, off the loopback, to the network. With a token configured, a request that comes
over TCP must carry ``Authorization: Bearer <token>``. The gManager and the instances (which ask
the leader to drain them when they stop) read the same token from a file.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path

MIN_TOKEN_CHARS = 16


def read_admin_token(path: Path | str) -> str:
    """The token in the file at ``path`` (surrounding whitespace dropped). Raises ValueError, with
    a message naming the file, where it cannot be read, is no regular file, is readable or
    writable by every user, is shorter than MIN_TOKEN_CHARS or holds anything but printable
    ASCII without spaces (the token goes in an HTTP header). Read once, at start: a new token
    takes a restart of the processes that read it."""
    try:
        # Not blocking: a FIFO at the path would hold the start for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"admin token file {path}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"admin token file {path}: not a regular file")
        raw = os.read(fd, 4097)
    except OSError as exc:
        raise ValueError(f"admin token file {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ValueError(f"admin token file {path}: readable or writable by every user (chmod o-rw)")
    if len(raw) > 4096:
        raise ValueError(f"admin token file {path}: over 4096 bytes")
    token = raw.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"admin token file {path}: the token must be at least {MIN_TOKEN_CHARS} characters")
    if not all(0x21 <= byte <= 0x7E for byte in token):
        raise ValueError(f"admin token file {path}: the token must be printable ASCII with no spaces")
    return token.decode("ascii")


def bearer_header(token: str) -> dict[str, str]:
    """The request header that carries ``token``."""
    return {"Authorization": f"Bearer {token}"}


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header's value carries ``token`` (compared in constant time;
    an empty token matches nothing)."""
    if authorization is None or not token:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Header bytes that are not UTF-8 come as surrogates (aiohttp's decoding): kept as bytes.
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token.encode())
