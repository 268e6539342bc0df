"""Who is calling on the local Unix socket: SO_PEERCRED, and who may change things.

Reading the daemon's state is open to anyone who can open the socket (mode 0660 limits that to
the socket's group); mutations (drain, generate) need root or membership of the admin group.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
# Linux's option for the peer's supplementary groups (since 4.13), as gid_t values; Python
# names it only on some builds.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS_READ = 256  # Python reads at most 1024 bytes of an option


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    # The peer's supplementary groups as the kernel has them (what systemd's
    # SupplementaryGroups=, docker --group-add or setpriv gave the process, which the group
    # database does not know); None where they could not be read.
    groups: tuple[int, ...] | None = None


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The credentials of the process at the other end of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw), groups=_peer_groups(sock))


def _peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_GROUPS_READ)
    except OSError:  # an older kernel, or more groups than read (ERANGE)
        return None
    return struct.unpack(f"{len(raw) // 4}I", raw[:len(raw) // 4 * 4])


def admin_group_id(name: str | None) -> int | None:
    """The gid of the configured admin group; ValueError when it does not exist."""
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"admin group {name!r} does not exist") from None


def may_mutate(creds: PeerCredentials, admin_gid: int | None) -> bool:
    """Root, the daemon's own user, or a process in the admin group (primary or supplementary:
    the kernel's list of the caller's groups where it could be read, else the group database's
    for the caller's user)."""
    if creds.uid == 0 or creds.uid == os.geteuid():
        return True
    if admin_gid is None:
        return False
    if creds.gid == admin_gid:
        return True
    if creds.groups is not None:
        return admin_gid in creds.groups
    try:
        user = pwd.getpwuid(creds.uid).pw_name
    except KeyError:
        return False
    return admin_gid in os.getgrouplist(user, creds.gid)
