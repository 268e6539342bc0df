"""An instance's life apart from its engine: the watchdog, a second stop signal, uncordon while
stopping. The daemon is built without starting it; its engine is a stand-in."""

from __future__ import annotations

import asyncio
import signal

import pytest

from infinite_llm.daemon.config import InstanceConfig
from infinite_llm.daemon.http_api import RequestRefused
from infinite_llm.daemon.instance import InstanceDaemon
from infinite_llm.transport.messages import Uncordon


class RecordingNotifier:
    """sd_notify's calls, counted; systemd's WatchdogSec of 0.1 s."""

    watchdog_interval_s = 0.05

    def __init__(self) -> None:
        self.pings = 0

    def watchdog(self) -> bool:
        self.pings += 1
        return True

    def status(self, text: str) -> None: ...
    def ready(self, text: str) -> None: ...
    def stopping(self, text: str) -> None: ...


class StuckEngine:
    """Has work, and its step never ends, though it lets the event loop turn (a hung device
    polled for its event)."""

    has_unfinished = True

    async def step_async(self):
        while True:
            await asyncio.sleep(0.001)

    def abort(self, request_id: str) -> None: ...


class IdleEngine:
    has_unfinished = False

    def abort(self, request_id: str) -> None: ...


def daemon(tmp_path) -> InstanceDaemon:
    made = InstanceDaemon(InstanceConfig(state_dir=str(tmp_path), http_port=None), notifier=RecordingNotifier())
    made._tick = lambda: None  # no membership, peers or heartbeats here
    made._publish = lambda: None
    return made


def pings_in(d: InstanceDaemon, engine, seconds: float) -> int:
    d.engine = engine

    async def run() -> int:
        loops = [asyncio.create_task(d._engine_loop()), asyncio.create_task(d._maintenance_loop())]
        await asyncio.sleep(seconds)
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        return d.notifier.pings

    return asyncio.run(run())


def test_the_watchdog_stops_when_a_step_never_ends_and_goes_on_while_idle(tmp_path):
    """A step stuck on a hung device leaves the event loop turning: only the missing pings get
    systemd to restart the instance. An engine with nothing to do is healthy."""
    assert pings_in(daemon(tmp_path), StuckEngine(), 1.0) <= 4  # pings for WatchdogSec at most, then none
    assert pings_in(daemon(tmp_path), IdleEngine(), 1.0) >= 12


def test_a_second_stop_signal_is_left_to_the_kernel(tmp_path):
    """After the first SIGTERM the event loop's handler is gone: the second ends the process
    even while the loop's thread is blocked in a device call and runs no handler."""
    d = daemon(tmp_path)

    async def run() -> object:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, d._on_signal)
        try:
            d._on_signal()
            return signal.getsignal(signal.SIGTERM)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    assert asyncio.run(run()) is signal.SIG_DFL
    assert d._stopping.is_set() and d.draining


def test_an_instance_that_is_stopping_cannot_be_uncordoned(tmp_path):
    """Neither the gManager nor the local API opens admission again mid-stop: new work would
    only wait for the stop's deadline and then fail."""
    d = daemon(tmp_path)

    async def run() -> None:
        d._on_signal()
        with pytest.raises(ValueError, match="is stopping"):
            d._handle(Uncordon(epoch=1, drain_id=1, inst_id=d.config.instance_id))
        with pytest.raises(RequestRefused, match="is stopping") as info:
            await d.uncordon()
        assert info.value.status == 409

    asyncio.run(run())
    assert d.draining


def test_a_stop_does_not_wait_out_its_deadline_for_an_engine_loop_that_ended(tmp_path):
    """The engine loop died (a bug): its requests can never finish, so the stop goes on to
    shut down rather than poll until ``drain_s``."""
    from types import SimpleNamespace

    from infinite_llm.daemon.ledger import CreditorLedger

    d = daemon(tmp_path)
    d.engine = SimpleNamespace(has_unfinished=True, scheduler=SimpleNamespace(requests={"1": None}))
    d.ledger = CreditorLedger(allocate=lambda n: None, free=lambda ids: None, reservation_ttl_s=5.0)

    async def run() -> float:
        async def died() -> None:
            raise RuntimeError("a bug in the engine loop")
        d._engine_task = asyncio.ensure_future(died())
        await asyncio.gather(d._engine_task, return_exceptions=True)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(d._drain_for_stop(), timeout=10)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(run()) < 2


def test_what_a_creditor_holds_for_a_home_that_restarted_is_freed(tmp_path):
    """A home restarted within debtor_lost_s keeps publishing under its id, so it never looks
    silent; its new process knows nothing of the old one's segments. The creditor frees them
    when the home's record names another process."""
    from infinite_llm.daemon.ledger import CreditorLedger
    from infinite_llm.daemon.membership import Member

    d = daemon(tmp_path)
    free = list(range(8))
    d.ledger = CreditorLedger(allocate=lambda n: [free.pop(0) for _ in range(n)], free=free.extend,
                              reservation_ttl_s=5.0)
    forgotten = []
    d.creditor = type("Creditor", (), {"forget": lambda self, home: forgotten.append(home)})()

    def home(pid: int) -> dict[int, Member]:
        return {2: Member(inst_id=2, pid=pid, peer_host="10.0.0.2", peer_port=5002, http_port=0, socket_path="",
                          num_blocks_total=8, num_blocks_free=8, draining=False, updated_at=0.0)}

    d._forget_restarted_homes(home(100))
    reservation = d.ledger.reserve(2, 1, 3, 0.0)
    d.ledger.commit(reservation.reservation_id, 2, 1, 0, 0.0)
    d.ledger.heard_from(2, 0.0)
    d._forget_restarted_homes(home(100))  # the same run: kept
    assert list(d.ledger.held) == [(2, 1, 0)] and len(free) == 5
    d._forget_restarted_homes(home(200))  # another process under instance id 2
    assert d.ledger.held == {} and len(free) == 8 and forgotten == [2]
    reservation = d.ledger.reserve(2, 1, 3, 1.0)  # the new run's request 1 is taken in again
    assert d.ledger.commit(reservation.reservation_id, 2, 1, 0, 1.0) is not None


def test_a_peers_failures_in_a_row_end_only_with_a_step_that_used_it(tmp_path):
    """A step that completes without the failing peer (its requests not in it) says nothing of
    that peer: its count stays, so a peer that keeps failing cannot escape the limit."""
    from types import SimpleNamespace

    from infinite_llm.engine.block_manager import BlockManager
    from infinite_llm.transport.interface import PeerAddress

    d = daemon(tmp_path)
    bm = BlockManager(block_size=4, pool_blocks=[8, 8])
    d.engine = SimpleNamespace(block_manager=bm)
    peer = d.peers.update(2, PeerAddress("127.0.0.1", 5002), 8, False, 8)
    assert peer.engine_id == 1  # the block manager's instance 1 stands for it
    bm.allocate("with_peer", 12)
    bm.commit_move(bm.lend("with_peer", 2, 1, num_written=12))
    bm.allocate("home_only", 4)
    d._peer_step_failures = {2: 2}
    d._peers_answered([SimpleNamespace(request_id="home_only")])
    assert d._peer_step_failures == {2: 2}
    d._peers_answered([SimpleNamespace(request_id="with_peer")])
    assert d._peer_step_failures == {}


def test_a_creditor_audits_each_home_once_a_period_and_frees_what_it_no_longer_counts_on(tmp_path):
    """The creditor's side of the audit as the tick drives it: a home first seen holding here is
    audited one ``held_audit_s`` later, and again a period after that; what the home answers
    stale is freed and counted."""
    from types import SimpleNamespace

    from infinite_llm.daemon.ledger import CreditorLedger
    from infinite_llm.daemon.metrics import InstanceMetrics
    from infinite_llm.daemon.peers import PeerDirectory, TransportLender
    from infinite_llm.engine.block_manager import BlockManager
    from infinite_llm.transport.interface import PeerAddress
    from infinite_llm.transport.memory import InMemoryNetwork
    from infinite_llm.transport.messages import AuditHeld

    d = daemon(tmp_path)  # instance 1, the creditor; held_audit_s 60
    network = InMemoryNetwork()
    d.transport = network.transport(PeerAddress("memory", 1))
    free = list(range(8))
    d.ledger = CreditorLedger(allocate=lambda n: [free.pop(0) for _ in range(n)], free=free.extend,
                              reservation_ttl_s=5.0)
    forgotten = []
    d.creditor = SimpleNamespace(forget=forgotten.append)
    d.peers.update(2, PeerAddress("memory", 2), 8, False, 8)
    for req_id in (1, 2):
        reservation = d.ledger.reserve(2, req_id, 2, 0.0)
        d.ledger.commit(reservation.reservation_id, 2, req_id, 0, 0.0)

    # Home 2: its request 1 is on this creditor still, request 2 ended (its free was lost).
    home_peers = PeerDirectory(2)
    creditor_there = home_peers.update(1, PeerAddress("memory", 1), 8, False, 8)
    bm = BlockManager(block_size=4, pool_blocks=[8])
    bm.allocate("1", 12)
    copy_of_1 = d.ledger.held[(2, 1, 0)].reservation_id
    bm.commit_move(bm.lend_to_remote("1", creditor_there.engine_id, (0, 1), num_written=12, copy_id=copy_of_1))
    home_engine = SimpleNamespace(block_manager=bm, config=SimpleNamespace(block_size=4))
    home = network.transport(PeerAddress("memory", 2))
    lender = TransportLender(home, home_peers, InstanceMetrics(), timeout_s=5.0)
    audits = []

    async def serve_home(message):
        audits.append(message)
        assert isinstance(message, AuditHeld)
        return lender.stale_held(home_engine, message)

    async def scenario() -> None:
        await home.start(serve_home)
        d._audit_held(now=100.0)  # first seen holding: nothing asked yet
        d._audit_held(now=159.0)
        await network.settle()
        assert audits == [] and d._audits == {}
        d._audit_held(now=160.0)
        d._audit_held(now=160.5)  # one audit per home at a time, and per period
        await asyncio.gather(*d._audits.values())
        assert len(audits) == 1
        assert sorted(d.ledger.held) == [(2, 1, 0)] and len(free) == 6
        assert d.metrics.held_blocks_reclaimed._value.get() == 2 and forgotten == []
        assert d.metrics.held_audits.labels(result="answered")._value.get() == 1
        d._audit_held(now=200.0)
        await network.settle()
        assert len(audits) == 1
        bm.free("1")  # request 1 ends too, and this free is lost as well
        d._audit_held(now=220.0)
        await asyncio.gather(*d._audits.values())
        assert len(audits) == 2 and d.ledger.held == {} and len(free) == 8 and forgotten == [2]
        d._audit_held(now=400.0)  # nothing held: nothing asked, and the home is forgotten
        assert d._audits == {} and d._audited_at == {}

    asyncio.run(scenario())


def test_a_prompt_is_tokenized_off_the_event_loop(tmp_path):
    """Tokenizing a prompt of megabytes takes seconds: the event loop serves peers, heartbeats
    and the watchdog meanwhile. Here the tokenizer waits until the loop has turned on its own."""
    import threading
    from types import SimpleNamespace

    from infinite_llm.engine.sampling import SamplingParams

    d = daemon(tmp_path)
    loop_turned = threading.Event()
    added = []

    def prompt_token_ids(prompt):
        assert loop_turned.wait(timeout=10), "the event loop did not turn while the prompt was tokenized"
        return [1, 2, 3]

    def add_request(token_ids, params, request_id):
        added.append(token_ids)
        d.engine.scheduler.requests[request_id] = SimpleNamespace(prompt_token_ids=token_ids)

    d.engine = SimpleNamespace(prompt_token_ids=prompt_token_ids, add_request=add_request, max_model_len=8192,
                               scheduler=SimpleNamespace(requests={}))

    async def scenario() -> None:
        async def turn() -> None:
            await asyncio.sleep(0.01)
            loop_turned.set()
        ticker = asyncio.create_task(turn())
        stream = d.generate("a long prompt", None, SamplingParams(max_tokens=1))
        first = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0.2)  # the request is queued: no step runs here to answer it
        assert added == [[1, 2, 3]]
        first.cancel()
        await ticker

    asyncio.run(scenario())


def test_requests_the_instance_ends_and_those_the_client_left_are_counted_as_finished(tmp_path):
    """``infllm_requests_finished_total`` counts a request failed by the instance as "error" and
    one whose client went away as "abort", beside those the engine finished; a request that had
    already ended is not counted again."""
    from types import SimpleNamespace

    d = daemon(tmp_path)
    requests = {"1": SimpleNamespace(output_token_ids=[5, 6]), "2": SimpleNamespace(output_token_ids=[]),
                "3": SimpleNamespace(output_token_ids=[])}
    d.engine = SimpleNamespace(scheduler=SimpleNamespace(requests=requests),
                               abort=lambda request_id: requests.pop(request_id, None), has_unfinished=False)
    d._queues["1"] = queue = asyncio.Queue()
    d._fail_requests(["1", "gone"], "the device failed")
    event = queue.get_nowait()
    assert (event.finished, event.finish_reason) == (True, "error")
    d._pending_aborts.update({"2", "3", "gone"})

    async def one_turn() -> None:
        loop = asyncio.create_task(d._engine_loop())
        await asyncio.sleep(0.05)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    asyncio.run(one_turn())
    finished = {sample.labels["reason"]: sample.value for sample in
                next(m for m in d.metrics.registry.collect() if m.name == "infllm_requests_finished").samples
                if sample.name.endswith("_total")}
    assert finished == {"error": 1.0, "abort": 2.0}


def test_a_move_dropped_as_stale_at_the_step_boundary_is_counted_once_everywhere(tmp_path):
    """/metrics and /v1/status give one figure of stale commands, whichever way one was dropped."""
    from infinite_llm.transport.messages import MoveKV

    d = daemon(tmp_path)

    async def run() -> bool:
        d.fence.admit(3)  # the leader of epoch 3 orders a move ...
        done = asyncio.get_running_loop().create_future()
        d._ordered_moves.append((MoveKV(epoch=3, move_id=1, home_inst_id=1, req_id=1, src_inst_id=2,
                                        dst_inst_id=3, num_blocks=4), done))
        d.fence.admit(5)  # ... and one of epoch 5 speaks before the step boundary
        await d._carry_out_ordered_moves()
        d.fence.admit(4)  # refused on arrival
        return done.result()

    assert asyncio.run(run()) is False
    counted = next(m for m in d.metrics.registry.collect() if m.name == "infllm_stale_epoch_commands")
    assert d.fence.num_refused == 2 == sum(s.value for s in counted.samples if s.name.endswith("_total")) + 1


class StartupRecorder:
    """The stages of a start-up, recorded; a stop can be asked for during the model's load."""

    def __init__(self, d: InstanceDaemon, stop_while_loading: bool) -> None:
        self.calls: list[str] = []
        self.d = d
        d.notifier = self
        self.watchdog_interval_s = None
        self.stop_while_loading = stop_while_loading

    def status(self, text: str) -> None: self.calls.append("STATUS")
    def ready(self, text: str) -> None: self.calls.append("READY")
    def watchdog(self) -> bool: return True
    def stopping(self, text: str, extend_timeout_s=None) -> None: self.calls.append("STOPPING")


def test_a_stop_asked_for_while_the_model_loads_ends_start_up_unregistered(tmp_path, monkeypatch):
    """SIGTERM during the load: no listener, no registration and no READY after it."""
    from types import SimpleNamespace

    d = daemon(tmp_path)
    recorder = StartupRecorder(d, stop_while_loading=True)

    async def load(self):
        self._on_signal()  # systemctl stop, while the load runs on
        await asyncio.sleep(0.05)
        recorder.calls.append("loaded")
        self.engine = SimpleNamespace(has_unfinished=False)

    async def start_http(self):
        recorder.calls.append("http")
        return []
    monkeypatch.setattr(InstanceDaemon, "_start_engine_and_transport", load)
    monkeypatch.setattr(InstanceDaemon, "_start_http", start_http)
    d._publish = lambda: recorder.calls.append("publish")
    asyncio.run(asyncio.wait_for(d.run(), 10))
    assert recorder.calls == ["STATUS", "loaded", "STOPPING"]


def test_a_drain_asked_for_while_the_daemon_stops_does_not_publish_its_record_again(tmp_path, monkeypatch):
    """Between the withdrawal of the record and the local API's close, a drain (POST /v1/drain, or
    a gManager's Drain) leaves the record withdrawn: it is removed on a clean stop."""
    from types import SimpleNamespace

    from infinite_llm.transport.messages import Drain

    d = InstanceDaemon(InstanceConfig(state_dir=str(tmp_path), http_port=None))
    StartupRecorder(d, stop_while_loading=False)
    d._free_for_others = lambda: 0
    record = tmp_path / "members" / "1.json"
    seen = {}

    async def load(self):
        self.engine = SimpleNamespace(has_unfinished=False, home_instance_id=0, scheduler=SimpleNamespace(requests={}),
                                      block_manager=SimpleNamespace(num_total_blocks=lambda home: 8))
        self.ledger = SimpleNamespace(num_blocks_held=0, num_blocks_reserved=0)
        self.transport = SimpleNamespace(address=SimpleNamespace(host="127.0.0.1", port=5000),
                                         close=lambda: asyncio.sleep(0))

    class Runner:
        async def cleanup(self):  # the local API closes after the record was withdrawn
            d._handle(Drain(epoch=1, drain_id=1, inst_id=1))
            await d.drain()
            seen["record after the drains"] = record.exists()

    async def start_http(self):
        return [Runner()]

    async def stop_soon(self):
        seen["record while serving"] = record.exists()
        self._on_signal()
        await asyncio.sleep(3600)
    monkeypatch.setattr(InstanceDaemon, "_start_engine_and_transport", load)
    monkeypatch.setattr(InstanceDaemon, "_start_http", start_http)
    monkeypatch.setattr(InstanceDaemon, "_engine_loop", stop_soon)
    monkeypatch.setattr(InstanceDaemon, "_maintenance_loop", lambda self: asyncio.sleep(3600))
    monkeypatch.setattr(InstanceDaemon, "_drain_for_stop", lambda self: asyncio.sleep(0))
    asyncio.run(asyncio.wait_for(d.run(), 10))
    assert seen == {"record while serving": True, "record after the drains": False}


def test_a_device_failure_during_the_stop_still_ends_the_daemon_as_failed(tmp_path, monkeypatch):
    """A sticky device error while running requests finish (the drain of a stop) is a failure:
    the daemon exits non-zero, and systemd's Restart=on-failure starts it again."""
    from types import SimpleNamespace

    from infinite_llm.daemon.instance import DeviceFailed

    d = InstanceDaemon(InstanceConfig(state_dir=str(tmp_path), http_port=None))
    StartupRecorder(d, stop_while_loading=False)
    d._publish = lambda: None

    async def load(self):
        self.engine = SimpleNamespace(has_unfinished=False)
        self.transport = SimpleNamespace(address="127.0.0.1:1", close=lambda: asyncio.sleep(0))

    async def stop_soon(self):
        self._on_signal()
        await asyncio.sleep(3600)

    async def drain_hits_a_device_error(self):
        self._device_failure = RuntimeError("CUDA error: an illegal memory access was encountered")

    async def registered(inst_id, timeout_s):
        return True
    monkeypatch.setattr(InstanceDaemon, "_start_engine_and_transport", load)
    monkeypatch.setattr(InstanceDaemon, "_start_http", lambda self: asyncio.sleep(0, []))
    monkeypatch.setattr(InstanceDaemon, "_engine_loop", stop_soon)
    monkeypatch.setattr(InstanceDaemon, "_maintenance_loop", lambda self: asyncio.sleep(3600))
    monkeypatch.setattr(InstanceDaemon, "_drain_for_stop", drain_hits_a_device_error)
    d.membership.wait_published = registered
    with pytest.raises(DeviceFailed, match="illegal memory access"):
        asyncio.run(asyncio.wait_for(d.run(), 10))
