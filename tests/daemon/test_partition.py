"""A real network partition: etcd and three `infinited` in network namespaces joined by veth
pairs on a bridge; the instance that holds part of a split request's KV is cut off, then healed.

Topology. Nothing is made in the root namespace, nor any of its interfaces or routes touched:
the bridge lives in a namespace of its own and every veth pair is made inside the namespaces.
Namespaces are named ``infllm-<pid>-*`` and links ``il<pid>*``; the fixture's teardown stops
every process it started there and deletes the namespaces (which takes their links with them),
whatever the test did.

    infllm-<pid>-sw     bridge il<pid>br; one port per node: il<pid>etcd, il<pid>i1, ...
    infllm-<pid>-etcd   etcd, 10.201.0.1:2379 (its only interface: il<pid>eth)
    infllm-<pid>-i<N>   infinited N, 10.201.0.1N: its UCX listener (--peer-host) and its
                        OpenAI API (--http-host); its local admin API is its Unix socket,
                        which the test drives (the files are shared across namespaces)

Nothing goes around the network: no shared-memory offers (``peer_shared_memory_bytes = 0``,
only settable in the config file), no header rings (``--peer-header-ring-bytes 0``), remote
attention by messages, and ``UCX_TLS=tcp,self`` (no UCX shared-memory transport between the
processes of this host). Leases last 2 s (``timeouts.etcd_lease_s``); heartbeats and upkeep
every 0.5 s; a peer request times out after 2 s; creditors audit held segments every second.

Where this container cannot make network namespaces, a bridge or veth pairs, the tests skip
with the command that failed and its error (after trying it).

The partition: the switch port of the creditor holding the most of a decoding request's KV goes
down (a pulled cable: no RST, no ICMP to either side). A watcher in the home's namespace (an
``EtcdMembership``, the code the daemons watch etcd with) times when the membership drops it.

What the daemon does, read from its code (daemon/etcd_discovery.py, daemon/instance.py):

* The others: etcd deletes the isolated instance's record when its lease runs out; their
  watches drop it. A home whose step then fails on that creditor finds it gone
  (``_peer_part_failed``) and recomputes the lost KV at once (``_recover_from_lost_peer``).
* The isolated instance: its lease refreshes time out (``EtcdMembership._write``: "etcd
  membership update failed"). Once a TTL has passed since its last refresh was sent, its lease
  may be gone (``EtcdMembership.registered`` is False) and it refuses new requests with 503
  (``InstanceDaemon._refuse_while_draining``); after the heal it registers again ("the
  membership lease expired: registering again") and takes work again.
* Its watch hangs with the link, so its own membership still lists the home: it keeps the
  home's segments (no ``debtor_lost_s`` expiry) that the home has recomputed elsewhere. After
  the heal its audit (``held_audit_s``) learns the home no longer counts on them and frees them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from etcd_testlib import ETCD_BINARY
from infinite_llm.daemon.local_cluster import Generation, Instance, passkey_prompt

POOL_BLOCKS = 40  # per instance; the prompt (752 tokens, 47 blocks) spills from its home
BLOCK_SIZE = 16
PROMPT = passkey_prompt(50)
MAX_TOKENS = 120
LEASE_S = 2
DETECTION_S = 5.0  # the partition must be seen within this
DUP_GRACE_S = 10.0  # after the heal, a block with two owners must lose one within this
SUBNET = "10.201.0"
ETCD_PORT = 2379
HTTP_PORT = 8000
INSTANCES = (1, 2, 3)
HOME = 1
START_S = 180.0
STOP_S = 15.0

INSTANCE_CONFIG = """\
# Nothing around the network: no shared-memory region offered to peers of this host.
peer_shared_memory_bytes = 0
remote_attention = "messages"

[timeouts]
etcd_lease_s = 2
etcd_request_s = 1.0
heartbeat_interval_s = 0.5
peer_request_s = 2.0
held_audit_s = 1.0
drain_s = 5.0
"""

# The healthy side's view of the membership: the daemons' own watch code, printing each change.
WATCHER = """\
import asyncio, json, sys
from infinite_llm.daemon.etcd_discovery import EtcdMembership

async def main():
    membership = EtcdMembership(sys.argv[1], prefix=sys.argv[2], lease_ttl_s=2, request_timeout_s=1.0)
    await membership.start()
    last = None
    while True:
        now = {str(i): [m.pid, m.run_id] for i, m in sorted(membership.members().items())}
        if now != last:
            print(json.dumps(now), flush=True)
            last = now
        await asyncio.sleep(0.02)

asyncio.run(main())
"""

ETCD_HEALTH = """\
import sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=1.0) as response:
            if b'"true"' in response.read():
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.1)
sys.exit(1)
"""

HTTP_GET = """\
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=10) as response:
    sys.stdout.write(response.read().decode())
"""


def sh(*args: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s, check=check)


def netns_names() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


class Topology:
    """Namespaces, a bridge and veth pairs of this process; ``close`` removes them all."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns_prefix = f"infllm-{pid}-"
        self.link_prefix = f"il{pid}"  # link names have at most 15 characters
        self.switch = self.ns_prefix + "sw"
        self.bridge = self.link_prefix + "br"
        self.node_if = self.link_prefix + "eth"
        self.namespaces: list[str] = []
        self.processes: list[subprocess.Popen] = []

    def ns(self, node: str) -> str:
        return self.ns_prefix + node

    def port(self, node: str) -> str:
        return self.link_prefix + node

    def build(self, nodes: dict[str, str]) -> None:
        """One namespace per node (node -> address), each on a port of the bridge. Skips the
        test, with the command and its error, where this container cannot make namespaces,
        bridges or veth pairs."""
        self._try("network namespaces", "ip", "netns", "add", self.switch)
        self.namespaces.append(self.switch)
        self._try("bridges", "ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", self.bridge, "up")
        for node, address in nodes.items():
            ns = self.ns(node)
            sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            # Made inside the namespaces: the root namespace never sees either end.
            self._try("veth pairs", "ip", "-n", self.switch, "link", "add", self.port(node), "type", "veth",
                      "peer", "name", self.node_if, "netns", ns)
            sh("ip", "-n", self.switch, "link", "set", self.port(node), "master", self.bridge, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", self.node_if)
            sh("ip", "-n", ns, "link", "set", self.node_if, "up")

    def _try(self, what: str, *args: str) -> None:
        result = sh(*args, check=False)
        if result.returncode != 0:
            pytest.skip(f"this container cannot make {what}: `{' '.join(args)}` exited {result.returncode}: "
                        f"{result.stderr.strip()}")

    def cut(self, node: str) -> None:
        """The node's cable pulled: its switch port down."""
        sh("ip", "-n", self.switch, "link", "set", self.port(node), "down")

    def heal(self, node: str) -> None:
        sh("ip", "-n", self.switch, "link", "set", self.port(node), "up")

    def tx_bytes(self, node: str) -> int:
        (link,) = json.loads(sh("ip", "-n", self.ns(node), "-j", "-s", "link", "show", "dev", self.node_if).stdout)
        return int(link["stats64"]["tx"]["bytes"])

    def spawn(self, node: str, args: list[str], log_path: Path, env: dict[str, str],
              stdout_pipe: bool = False) -> subprocess.Popen:
        with open(log_path, "w") as log:
            process = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *args],
                                       stdout=subprocess.PIPE if stdout_pipe else log,
                                       stderr=log if stdout_pipe else subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, text=stdout_pipe, start_new_session=True)
        self.processes.append(process)
        return process

    def run_in(self, node: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns(node), *args, check=False, timeout_s=timeout_s)

    def close(self) -> None:
        """Stop every process started here (SIGTERM, SIGKILL after STOP_S), then delete the
        namespaces, which takes their veths and the bridge with them. Raises if any is left."""
        for process in self.processes:
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_S
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=10)
        for ns in reversed(self.namespaces):
            # Only this fixture enters these namespaces: whatever is still inside was started here.
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)
        left = [name for name in netns_names() if name.startswith(self.ns_prefix)]
        if left:
            raise RuntimeError(f"network namespaces left behind: {left}")


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


class MembershipWatch:
    """The watcher's output: each change of the membership, with when it arrived here."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.changes: list[tuple[float, dict[int, tuple[int, int]]]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                members = {int(k): tuple(v) for k, v in json.loads(line).items()}
            except ValueError:
                continue
            with self._lock:
                self.changes.append((time.monotonic(), members))

    def current(self) -> dict[int, tuple[int, int]]:
        with self._lock:
            return dict(self.changes[-1][1]) if self.changes else {}

    def wait(self, predicate: Callable[[dict[int, tuple[int, int]]], bool], timeout_s: float,
             since: float = 0.0) -> float | None:
        """When (time.monotonic()) a membership arrived at or after ``since`` that satisfies
        ``predicate``; None if none within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                for at, members in self.changes:
                    if at >= since and predicate(members):
                        return at
                if self.changes and self.changes[-1][0] < since and predicate(self.changes[-1][1]):
                    return since
            if time.monotonic() >= deadline or self.process.poll() is not None:
                return None
            time.sleep(0.02)


def wait_until(condition: Callable[[], Any], timeout_s: float, interval_s: float = 0.1) -> Any:
    """``condition()``'s first true value within ``timeout_s``; None otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value or None
        time.sleep(interval_s)


def log_has(instance: Instance, text: str, offset: int = 0) -> bool:
    return text in instance.log_path.read_text(errors="replace")[offset:]


def log_size(instance: Instance) -> int:
    return len(instance.log_path.read_text(errors="replace"))


# ---- who owns which KV block -------------------------------------------------------------------
Block = tuple[int, int, int]  # (home instance, request id, block index in the request)


def owners(statuses: dict[int, dict[str, Any]]) -> tuple[dict[Block, list[int]], dict[Block, list[int]]]:
    """Per block of every request: the instances the home's table places it on (its
    ``requests[*].segments``), and the creditors whose ``held_segments`` hold it."""
    table: dict[Block, list[int]] = defaultdict(list)
    held: dict[Block, list[int]] = defaultdict(list)
    for home, status in statuses.items():
        for request in status["requests"]:
            for segment in request["segments"]:
                first = segment["token_start"] // BLOCK_SIZE
                for block in range(first, first + len(segment["block_ids"])):
                    table[(home, int(request["request_id"]), block)].append(segment["instance_id"])
    for creditor, status in statuses.items():
        for segment in status["held_segments"]:
            # A held segment's id is its first block's index (token_start // block_size).
            for block in range(segment["segment_id"], segment["segment_id"] + segment["num_blocks"]):
                held[(segment["home_instance_id"], segment["request_id"], block)].append(creditor)
    return table, held


def duplicate_owners(statuses: dict[int, dict[str, Any]]) -> dict[Block, tuple[int, ...]]:
    """Blocks that two instances hold (or one table names twice): the home's table and the
    creditors' held segments together name more than one copy."""
    table, held = owners(statuses)
    found = {}
    for key in table.keys() | held.keys():
        placed, holding = table.get(key, []), held.get(key, [])
        if len(placed) > 1 or len(holding) > 1 or len(set(placed) | set(holding)) > 1:
            found[key] = tuple(sorted(placed + holding))
    return found


def stray_holds(statuses: dict[int, dict[str, Any]]) -> dict[Block, tuple[int, ...]]:
    """Blocks a creditor holds that the home's table does not place there."""
    table, held = owners(statuses)
    return {key: tuple(creditors) for key, creditors in held.items()
            if any(c not in table.get(key, []) for c in creditors)}


def describe(blocks: dict[Block, tuple[int, ...]]) -> str:
    return ", ".join(f"home {h} request {r} block {b}: {list(o)}" for (h, r, b), o in sorted(blocks.items())) or "none"


# ---- the scenario ------------------------------------------------------------------------------
@dataclass
class Observed:
    """What the partition scenario saw; each test judges its part."""

    holder: int = 0
    survivor: int = 0
    held_before_cut: list[dict] = field(default_factory=list)
    reference: list[int] = field(default_factory=list)
    gone_after_s: float | None = None  # cut -> the watcher's membership lacks the holder
    isolated_failure_after_s: float | None = None  # cut -> "etcd membership update failed" in its log
    home_saw_it_leave: bool = False
    home_recomputed: bool = False
    home_segments_on_holder_after_recompute: list[dict] = field(default_factory=list)
    isolated_reply: tuple[int, Any] | None = None
    isolated_reply_after_lease_s: float | None = None  # the lease gone -> the answer
    isolated_still_unregistered: bool = False
    held_during_partition: list[dict] = field(default_factory=list)
    duplicates_before_heal: dict = field(default_factory=dict)
    duplicates_at_heal: dict = field(default_factory=dict)
    stale_resolved_after_s: float | None = None
    persistent_duplicate: dict | None = None  # a duplicate older than DUP_GRACE_S after the heal
    rejoined_after_s: float | None = None
    reregistered_logged: bool = False
    split_tokens: list[int] = field(default_factory=list)
    split_finish_reason: str | None = None
    split_error: BaseException | None = None
    final: dict[int, dict] = field(default_factory=dict)
    final_duplicates: dict = field(default_factory=dict)
    final_strays: dict = field(default_factory=dict)
    home_metrics: str = ""
    home_log: str = ""
    shared_memory: dict = field(default_factory=dict)
    tx_bytes: dict[int, int] = field(default_factory=dict)
    membership_at_start: dict = field(default_factory=dict)
    membership_at_end: dict = field(default_factory=dict)

    def summary(self) -> str:
        def s(value: float | None) -> str:
            return "never" if value is None else f"{value:.2f} s"

        code = None if self.isolated_reply is None else self.isolated_reply[0]
        return "\n".join([
            f"partition: cut instance {self.holder} (held {sum(x['num_blocks'] for x in self.held_before_cut)} blocks "
            f"of the home's request); survivor {self.survivor}",
            f"  membership dropped it after {s(self.gone_after_s)}; its lease refresh failed after "
            f"{s(self.isolated_failure_after_s)}; home saw it leave: {self.home_saw_it_leave}",
            f"  new request to the isolated instance, {s(self.isolated_reply_after_lease_s)} after its lease was gone: "
            f"HTTP {code}",
            f"  held by it during the partition: {self.held_during_partition}",
            f"  blocks with two owners before the heal: {describe(self.duplicates_before_heal)}",
            f"  blocks with two owners at the heal: {describe(self.duplicates_at_heal)}; resolved after "
            f"{s(self.stale_resolved_after_s)}; rejoined etcd after {s(self.rejoined_after_s)}",
            f"  split request: {len(self.split_tokens)} tokens, {self.split_finish_reason}, "
            f"same as undisturbed: {self.split_tokens == self.reference}; error {self.split_error}",
            f"  bytes sent on each instance's veth: {self.tx_bytes}",
        ])


@pytest.fixture(scope="module")
def partition(tmp_path_factory):
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    if not os.access(ETCD_BINARY, os.X_OK):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    root = tmp_path_factory.mktemp("partition")
    socket_dir = Path(tempfile.mkdtemp(prefix="infllm-part-"))  # Unix socket paths stay short
    topology = Topology()
    try:
        nodes = {"etcd": f"{SUBNET}.1", **{f"i{i}": f"{SUBNET}.1{i}" for i in INSTANCES}}
        topology.build(nodes)
        yield run_scenario(topology, nodes, root, socket_dir)
    finally:
        topology.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def run_scenario(topology: Topology, nodes: dict[str, str], root: Path, socket_dir: Path) -> Observed:
    obs = Observed()
    env = dict(os.environ, UCX_TLS="tcp,self", UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    etcd_address = nodes["etcd"]
    endpoint = f"{etcd_address}:{ETCD_PORT}"
    client_url, peer_url = f"http://{endpoint}", f"http://{etcd_address}:{ETCD_PORT + 1}"
    topology.spawn("etcd", [ETCD_BINARY, "--name", "part", "--data-dir", str(root / "etcd-data"),
                            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                            "--initial-cluster", f"part={peer_url}", "--log-level", "warn"],
                   root / "etcd.log", env)
    health = topology.run_in("etcd", [sys.executable, "-c", ETCD_HEALTH, f"{client_url}/health", "20"], timeout_s=30)
    assert health.returncode == 0, f"etcd did not become healthy: {(root / 'etcd.log').read_text()[-2000:]}"

    config = root / "infinited.toml"
    config.write_text(INSTANCE_CONFIG)
    prefix = "/partition"
    instances: dict[int, Instance] = {}
    for i in INSTANCES:
        address = nodes[f"i{i}"]
        socket_path, log_path = socket_dir / f"i{i}.sock", root / f"infinited-{i}.log"
        process = topology.spawn(f"i{i}", [
            sys.executable, "-m", "infinite_llm.daemon", "--config", str(config), "--instance-id", str(i),
            "--kv-pool-blocks", str(POOL_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-batched-tokens", "128",
            "--device", "cpu", "--peer-host", address, "--http-host", address, "--http-port", str(HTTP_PORT),
            "--peer-header-ring-bytes", "0", "--socket-path", str(socket_path), "--state-dir", str(root / f"state{i}"),
            "--etcd-endpoints", endpoint, "--etcd-prefix", prefix, "--etcd-lease-s", str(LEASE_S)], log_path, env)
        instances[i] = Instance(i, process, socket_path, log_path, http_port=HTTP_PORT)
    watch = MembershipWatch(topology.spawn(f"i{HOME}", [sys.executable, "-c", WATCHER, endpoint, prefix],
                                           root / "watcher.log", env, stdout_pipe=True))

    def all_up():
        for inst in instances.values():
            if inst.process.poll() is not None:
                raise RuntimeError(f"instance {inst.inst_id} exited: {inst.log_path.read_text()[-3000:]}")
        return set(watch.current()) >= set(INSTANCES) and all(inst.socket_path.exists() for inst in instances.values())

    assert wait_until(all_up, START_S, interval_s=0.5), (
        f"the cluster did not register in etcd within {START_S} s; watcher: {(root / 'watcher.log').read_text()[-2000:]}")
    obs.membership_at_start = watch.current()
    time.sleep(1.5)  # upkeep ticks: every instance reads every other's record
    home = instances[HOME]

    # The undisturbed run, for comparison; then the creditors free what they held of it.
    reference = Generation(home, PROMPT, max_tokens=MAX_TOKENS, timeout_s=300)
    obs.reference = reference.join()
    assert wait_until(lambda: not any(instances[i].status()["held_segments"] for i in INSTANCES), 30), \
        "the creditors did not free the reference's KV"

    split = Generation(home, PROMPT, max_tokens=MAX_TOKENS, timeout_s=300)
    # On a failure below, the teardown stops the daemons, which ends this stream.
    assert wait_until(lambda: len(split.tokens) >= 20 or not split.thread.is_alive(), 180), "no decode"

    def held_for_home(i: int) -> list[dict]:
        return [s for s in instances[i].status()["held_segments"] if s["home_instance_id"] == HOME]

    holders = {i: held_for_home(i) for i in INSTANCES if i != HOME}
    assert any(holders.values()), f"the home spilled nothing to its peers: {holders}"
    obs.holder = max(holders, key=lambda i: sum(s["num_blocks"] for s in holders[i]))
    obs.survivor = next(i for i in INSTANCES if i not in (HOME, obs.holder))
    obs.held_before_cut = holders[obs.holder]
    isolated = instances[obs.holder]
    isolated_offset, home_offset = log_size(isolated), log_size(home)

    # ---- the partition -------------------------------------------------------------
    cut_at = time.monotonic()
    topology.cut(f"i{obs.holder}")
    # Both sides at once: the healthy side's membership, and the isolated instance's log.
    gone_at = failed_at = None
    while (gone_at is None or failed_at is None) and time.monotonic() < cut_at + 3 * DETECTION_S:
        if gone_at is None:
            gone_at = watch.wait(lambda m: obs.holder not in m, 0, since=cut_at)
        if failed_at is None and log_has(isolated, "etcd membership update failed", isolated_offset):
            failed_at = time.monotonic()
        time.sleep(0.05)
    obs.gone_after_s = None if gone_at is None else gone_at - cut_at
    obs.isolated_failure_after_s = None if failed_at is None else failed_at - cut_at
    obs.home_saw_it_leave = bool(wait_until(lambda: log_has(
        home, f"instance {obs.holder}, which held part of the KV of 1 requests, left the cluster", home_offset), 20))
    obs.home_recomputed = bool(wait_until(lambda: log_has(home, "it decodes again", home_offset), 30))
    obs.home_segments_on_holder_after_recompute = [
        s for r in home.status()["requests"] for s in r["segments"] if s["instance_id"] == obs.holder]

    # A new request to the isolated instance, from a client on its side (its local API),
    # once its lease is gone for the rest of the cluster.
    if gone_at is not None:
        obs.isolated_reply = isolated.local("POST", "/v1/generate", {
            "prompt": "The sky is", "params": {"temperature": 0, "max_tokens": 4}}, timeout=60)
        obs.isolated_reply_after_lease_s = time.monotonic() - gone_at
        obs.isolated_still_unregistered = obs.holder not in watch.current()
    statuses = {i: instances[i].status() for i in INSTANCES}
    obs.held_during_partition = [s for s in statuses[obs.holder]["held_segments"] if s["home_instance_id"] == HOME]
    obs.duplicates_before_heal = duplicate_owners(statuses)

    # ---- the heal ------------------------------------------------------------------
    heal_at = time.monotonic()
    topology.heal(f"i{obs.holder}")
    first_seen: dict[tuple[Block, tuple[int, ...]], float] = {}
    stale = None
    deadline = heal_at + 120
    while time.monotonic() < deadline:
        statuses = {i: instances[i].status() for i in INSTANCES}
        now = time.monotonic()
        dups = duplicate_owners(statuses)
        if stale is None:
            stale = obs.duplicates_at_heal = dups
        if obs.stale_resolved_after_s is None and not (set(stale) & set(dups)):
            obs.stale_resolved_after_s = now - heal_at
        seen_now = set(dups.items())
        for key in list(first_seen):
            if key not in seen_now:
                del first_seen[key]
        for key in seen_now:
            first_seen.setdefault(key, now)
        old = {k: v for (k, v), since in first_seen.items() if now - since > DUP_GRACE_S}
        if old:
            obs.persistent_duplicate = old
            break
        if obs.rejoined_after_s is None and watch.current().get(obs.holder) == obs.membership_at_start[obs.holder]:
            obs.rejoined_after_s = now - heal_at
        if (not split.thread.is_alive() and not dups and obs.rejoined_after_s is not None
                and not any(s["requests"] or s["held_segments"] for s in statuses.values())):
            break
        time.sleep(0.2)
    obs.reregistered_logged = log_has(isolated, "the membership lease expired: registering again", isolated_offset)
    split.thread.join(timeout=300)
    obs.split_tokens, obs.split_finish_reason, obs.split_error = split.tokens, split.finish_reason, split.error

    wait_until(lambda: not any(instances[i].status()["held_segments"] for i in INSTANCES), 15)
    obs.final = {i: instances[i].status() for i in INSTANCES}
    obs.final_duplicates = duplicate_owners(obs.final)
    obs.final_strays = stray_holds(obs.final)
    obs.membership_at_end = watch.current()
    obs.shared_memory = {i: obs.final[i]["peer_shared_memory"] for i in INSTANCES}
    obs.tx_bytes = {i: topology.tx_bytes(f"i{i}") for i in INSTANCES}
    # The home's OpenAI API, over the bridge from the survivor's namespace.
    metrics = topology.run_in(f"i{obs.survivor}", [sys.executable, "-c", HTTP_GET,
                                                   f"http://{nodes[f'i{HOME}']}:{HTTP_PORT}/metrics"], timeout_s=30)
    obs.home_metrics = metrics.stdout
    obs.home_log = home.log_path.read_text(errors="replace")
    print(obs.summary())  # shown with -s or -rA
    return obs


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- the tests ---------------------------------------------------------------------------------
def test_peers_talk_over_the_veth_pairs_only(partition: Observed) -> None:
    obs = partition
    assert obs.held_before_cut, "the home spilled to the creditor that was cut off"
    for i, shared in obs.shared_memory.items():
        assert not shared["region"] and not shared["peers"] and not shared["header_ring_peers"], (i, shared)
        assert not shared["header_ring_inbound"], (i, shared)
    # Two runs of a 752-token prompt spilled KV blocks of 720 KiB each over the home's veth.
    assert obs.tx_bytes[HOME] > 10 * 737_280, obs.tx_bytes
    assert metric(obs.home_metrics, "infllm_generated_tokens_total") >= 2 * MAX_TOKENS, obs.home_metrics[:500]


def test_partition_is_detected_within_5_s(partition: Observed) -> None:
    obs = partition
    # The healthy side's membership (the daemons' etcd watch, from the home's namespace).
    assert obs.gone_after_s is not None, "the cut-off instance never left the membership"
    assert obs.gone_after_s < DETECTION_S, f"the membership dropped instance {obs.holder} after {obs.gone_after_s:.2f} s"
    # The isolated instance's own side: its lease refreshes fail.
    assert obs.isolated_failure_after_s is not None and obs.isolated_failure_after_s < DETECTION_S, \
        obs.isolated_failure_after_s
    # The home's own membership view dropped it: its failed step found the creditor gone.
    assert obs.home_saw_it_leave, obs.home_log[-3000:]


def test_isolated_instance_refuses_new_work_once_its_lease_is_gone(partition: Observed) -> None:
    obs = partition
    assert obs.isolated_reply is not None, "no request was sent to the isolated instance"
    assert obs.isolated_still_unregistered, "the isolated instance was back in the membership when it answered"
    code, body = obs.isolated_reply
    assert code == 503, (f"instance {obs.holder}, {obs.isolated_reply_after_lease_s:.1f} s after its lease was gone, "
                         f"answered {code}: {body!r}")


def test_the_split_request_recomputes_and_ends_as_the_undisturbed_run(partition: Observed) -> None:
    obs = partition
    assert len(obs.reference) == MAX_TOKENS
    assert obs.home_recomputed, obs.home_log[-3000:]
    assert f"instance {obs.holder}, which held part of the KV of 1 requests, left the cluster" in obs.home_log
    # Once recomputed, the home's table names nothing on the cut-off instance.
    assert obs.home_segments_on_holder_after_recompute == []
    assert obs.split_error is None, obs.split_error
    assert obs.split_finish_reason == "length" and obs.split_tokens == obs.reference
    held_blocks = sum(s["num_blocks"] for s in obs.held_before_cut)
    assert metric(obs.home_metrics, "infllm_segments_recomputed_total") >= 1
    assert metric(obs.home_metrics, "infllm_tokens_recomputed_total") >= held_blocks * BLOCK_SIZE - BLOCK_SIZE
    assert metric(obs.home_metrics, 'infllm_requests_finished_total{reason="error"}') == 0


def test_healing_leaves_no_duplicate_owner_of_any_kv_block(partition: Observed) -> None:
    obs = partition
    assert obs.persistent_duplicate is None, (
        f"after the heal, blocks kept two owners for over {DUP_GRACE_S} s: {describe(obs.persistent_duplicate)}")
    assert obs.stale_resolved_after_s is not None and obs.stale_resolved_after_s < DUP_GRACE_S, (
        f"blocks with two owners at the heal: {describe(obs.duplicates_at_heal)}")
    # The cut-off instance came back under the same process and run, through a new lease.
    assert obs.rejoined_after_s is not None and obs.rejoined_after_s < 15, obs.membership_at_end
    assert obs.membership_at_end == obs.membership_at_start
    assert obs.reregistered_logged
    # At the end nobody holds anything: no duplicate, no stray hold, every pool free.
    assert obs.final_duplicates == {}, describe(obs.final_duplicates)
    assert obs.final_strays == {}, describe(obs.final_strays)
    for i, status in obs.final.items():
        assert status["requests"] == [] and status["held_segments"] == [], (i, status)
        assert status["pool"]["num_blocks_free"] == POOL_BLOCKS, (i, status["pool"])
