"""The systemd notification protocol, written out: datagrams to ``$NOTIFY_SOCKET``.

``READY=1`` once the listeners are up and the instance is registered, ``STATUS=...`` lines for
``systemctl status``, ``WATCHDOG=1`` at half of ``$WATCHDOG_USEC``, and ``STOPPING=1`` when a
graceful stop begins (with ``EXTEND_TIMEOUT_USEC`` for its last phase). Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping


class SystemdNotifier:
    """Sends sd_notify messages; one datagram per call, never blocking the caller: a message
    that finds the socket's queue full is dropped (the call returns False)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            # An abstract socket: the name starts with a NUL byte instead of '@'.
            address = "\0" + address[1:]
        self._address = address or None
        self._watchdog_usec = _watchdog_usec(env)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send ``WATCHDOG=1``: half of systemd's ``WatchdogSec``; None: no watchdog."""
        return None if self._watchdog_usec is None else self._watchdog_usec / 2e6

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased). Returns whether a datagram was sent."""
        if self._address is None:
            return False
        payload = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            try:
                # The caller is the event loop's thread. A datagram to a reader that is not
                # reading (PID 1 busy) waits for room in its queue: better lost than that wait.
                sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
            except OSError:
                # systemd gone, the socket not writable or its queue full (EAGAIN):
                # notifications are advisory, and the next ping or status says it again.
                return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status)

    def status(self, status: str) -> bool:
        return self.notify(status=status)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def stopping(self, status: str, extend_timeout_s: float | None = None) -> bool:
        """``STOPPING=1``; with ``extend_timeout_s``, also ``EXTEND_TIMEOUT_USEC``: systemd then
        waits that much longer for the stop to end should it run past ``TimeoutStopSec`` (the
        last phase of a stop that used up its drain time)."""
        if extend_timeout_s is None:
            return self.notify(stopping=1, status=status)
        return self.notify(stopping=1, status=status, extend_timeout_usec=max(1, round(extend_timeout_s * 1e6)))


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    usec = env.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID")
    # WATCHDOG_PID names the process systemd watches; a child that inherited it must not ping.
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec)
