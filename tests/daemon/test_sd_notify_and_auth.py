import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infinite_llm.daemon.local_auth import PeerCredentials, admin_group_id, may_mutate, peer_credentials
from infinite_llm.daemon.sd_notify import SystemdNotifier


@pytest.fixture
def notify_socket(tmp_path: Path):
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    yield path, sock
    sock.close()


def test_messages_reach_the_notify_socket(notify_socket) -> None:
    path, sock = notify_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())})
    assert notifier.enabled and notifier.watchdog_interval_s == 2.0
    assert notifier.ready("serving on port 9")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving on port 9"
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert notifier.stopping("draining")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    assert notifier.stopping("stopping", extend_timeout_s=42.5)
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=stopping\nEXTEND_TIMEOUT_USEC=42500000"


def test_abstract_socket_address() -> None:
    name = f"infllm-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert SystemdNotifier({"NOTIFY_SOCKET": "@" + name}).status("x")
        assert sock.recv(100) == b"STATUS=x"


def test_without_systemd_nothing_is_sent() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert notifier.ready("x") is False


def test_watchdog_meant_for_another_process_is_ignored() -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert notifier.watchdog_interval_s is None


def test_a_vanished_socket_is_not_an_error(tmp_path: Path) -> None:
    assert SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).ready("x") is False


def test_a_notify_socket_that_is_not_read_never_blocks_the_caller(tmp_path: Path) -> None:
    """PID 1 busy: its socket's queue fills, and each later message is dropped at once (False)
    rather than waiting in sendto on the event loop's thread."""
    import threading
    import time

    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as never_read:
        never_read.bind(str(path))
        notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
        results: list[bool] = []

        def ping() -> None:
            deadline = time.monotonic() + 5  # bounded between calls; a call blocked in sendto never returns
            while time.monotonic() < deadline and len(results) < 100_000:
                results.append(notifier.watchdog())
                if results[-1] is False and results.count(False) >= 100:
                    return

        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        pinger.join(10)
        assert not pinger.is_alive(), f"watchdog() blocked after {len(results)} calls"
        assert results[0] is True and results.count(False) >= 100
        assert results[results.index(False):] == [False] * results.count(False)  # dropped from the full queue on
        assert never_read.recv(100) == b"WATCHDOG=1"  # those that found room arrived
    assert notifier.watchdog() is False  # nobody listens any more: dropped, not raised


def test_peer_credentials_of_a_real_connection() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        creds = peer_credentials(a)
    assert (creds.pid, creds.uid, creds.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert creds.groups is not None and set(creds.groups) == set(os.getgroups())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a process groups of its own")
def test_a_callers_supplementary_groups_are_read_from_the_kernel() -> None:
    """A process given the admin group as a supplementary group (systemd's SupplementaryGroups=,
    docker --group-add), which the group database does not list for its user, may mutate."""
    path = f"\0infllm-auth-test-{os.getpid()}"  # abstract: no file the child's user must reach
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with server:
        server.bind(path)
        server.listen(1)
        child = subprocess.Popen([sys.executable, "-c", (
            "import os, socket, time; os.setgroups([54330]); os.setgid(54321); os.setuid(54321); "
            f"s = socket.socket(socket.AF_UNIX); s.connect({path!r}); time.sleep(5)")])
        try:
            server.settimeout(10)
            connection, _ = server.accept()
            with connection:
                creds = peer_credentials(connection)
        finally:
            child.kill()
            child.wait(timeout=10)
    assert (creds.uid, creds.gid, creds.groups) == (54321, 54321, (54330,))
    assert may_mutate(creds, 54330)
    assert not may_mutate(creds, 54331)


def test_who_may_mutate() -> None:
    assert may_mutate(PeerCredentials(1, 0, 0), None)  # root
    assert may_mutate(PeerCredentials(1, os.geteuid(), 0), None)  # the daemon's own user
    stranger = PeerCredentials(1, 54321, 54321)
    assert not may_mutate(stranger, None)
    assert may_mutate(stranger, 54321)  # primary group is the admin group
    assert not may_mutate(stranger, 54322)
    assert may_mutate(PeerCredentials(1, 54321, 54321, groups=(7, 54322)), 54322)  # a supplementary group
    assert not may_mutate(PeerCredentials(1, 54321, 54321, groups=()), 54322)


def test_unknown_admin_group_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="admin group 'no-such-group-x' does not exist"):
        admin_group_id("no-such-group-x")
    assert admin_group_id("root") == 0


def test_the_local_socket_is_taken_over_only_from_a_killed_run(tmp_path: Path) -> None:
    """A socket file nobody listens on (a killed run's) is replaced, mode 0660 from its first
    connection on; one a live process listens on is left to it, with a clear error."""
    import asyncio
    import stat

    from aiohttp import web

    from infinite_llm.daemon.http_api import LocalSocketInUse, start_local_site

    path = tmp_path / "infllm.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, and refuses connections

    async def pong(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def serve_twice() -> tuple[int, str]:
        app = web.Application()
        app.router.add_get("/ping", pong)
        runner = web.AppRunner(app)
        await runner.setup()
        await start_local_site(runner, path, admin_group=None)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        second = web.AppRunner(web.Application())
        await second.setup()
        try:
            await start_local_site(second, path, admin_group=None)
            refusal = ""
        except LocalSocketInUse as exc:
            refusal = str(exc)
        reader, writer = await asyncio.open_unix_connection(str(path))  # the first still serves
        writer.write(b"GET /ping HTTP/1.0\r\n\r\n")
        answer = await reader.read()
        writer.close()
        await second.cleanup()
        await runner.cleanup()
        assert answer.endswith(b"pong")
        return mode, refusal

    mode, refusal = asyncio.run(serve_twice())
    assert mode == 0o660
    assert "socket of a running process" in refusal
