"""One `infinited` instance: engine, creditor ledger, transport, local and OpenAI APIs.

The event loop runs everything: the engine's steps (which await remote attention at every
layer, so the loop serves peers' attend requests while its own step waits), the transport's
handlers, the HTTP servers, and a maintenance tick (membership, expired reservations, silent
debtors, metrics, the systemd watchdog).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import random
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import torch
from aiohttp import web

from infinite_llm.engine.block_manager import Segment, SegmentMove
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine, RequestRejected
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams
from infinite_llm.transport.errors import PlacementRefused, TransportError
from infinite_llm.transport.interface import PeerAddress, Transport, TransportConfig
from infinite_llm.transport.messages import (
    APBChunkDone,
    APBChunkPrefill,
    APBPassing,
    AttendRequest,
    AuditHeld,
    Drain,
    Echo,
    EchoReply,
    ErrorCode,
    ErrorReply,
    ForwardSegment,
    FreeSegment,
    Heartbeat,
    HeartbeatReply,
    HoldKV,
    KVBlocks,
    KVBlocksStored,
    KVHoldReply,
    Message,
    MoveCommit,
    MoveKV,
    MoveRejected,
    MoveRejectReason,
    MoveReserved,
    PoolFigures,
    RequestPlacementEntry,
    StepBegin,
    StepMailboxClose,
    StepStandDown,
    StepMailboxOpen,
    TryMoveKV,
    Uncordon,
)
from infinite_llm.transport.step_mailbox import host_id

from . import failpoints
from .apb import APBAborted, APBInbox, TransportHostGroup, prefill_chunk
from .apb_plan import APBPlan, PrefillOptions, plan_apb
from .config import InstanceConfig, peer_spin_for
from .creditor import CreditorAttention
from .step_attention import MailboxRemoteAttention
from .step_server import StepServer
from .handover import HandOver, blocks_held_by_home, describe_held, find_leader_admin
from .heartbeat import HeartbeatState
from .http_api import GenerationEvent, LocalApp, OpenAIApp, RequestRefused, start_local_site
from .ledger import CreditorLedger, EpochFence, LedgerError
from .local_auth import admin_group_id
from .membership import Member, membership_for, process_alive
from .metrics import InstanceMetrics
from .peers import (
    Peer,
    PeerDirectory,
    PeerPartFailed,
    TransportLender,
    TransportRemoteAttention,
    audit_held,
    forward_segment,
)
from .sd_notify import SystemdNotifier

log = logging.getLogger(__name__)

# A step whose creditor part failed runs again up to this many times in a row before that
# creditor counts as lost and the requests with KV there recompute it (a peer busy in a long
# step of its own, or reconnecting, recovers within a retry; a dead one leaves the cluster's
# membership and counts as lost at once).
PEER_STEP_RETRIES = 3
PEER_RETRY_PAUSE_S = 0.1  # before the n-th retry of a step: n times this
# A creditor counted lost takes no blocks for this long, or until it restarts: its entry in the
# membership outlives a killed process by up to a lease, and a move to it would fail meanwhile.
LOST_PEER_QUARANTINE_S = 30.0

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceFailed(RuntimeError):
    """The accelerator reported an error that leaves this process unable to run kernels."""


class StartupError(RuntimeError):
    """A stage of start-up failed (e.g. the instance could not register); the message says which."""


# CUDA errors that corrupt the context: every later call of the process fails with them too.
_STICKY_CUDA_ERRORS = ("illegal memory access", "illegal address", "illegal instruction", "misaligned address",
                       "unspecified launch failure", "device-side assert", "uncorrectable ECC",
                       "hardware stack error", "launch timed out")


# At a stop, how long each HTTP API waits for its handlers to end (aiohttp's default is 60 s).
# The running requests have ended by then: streams close at once.
HTTP_SHUTDOWN_S = 5.0


def cleanup_budget_s(config: InstanceConfig, frame_timeout_s: float) -> float:
    """The most the last phase of a stop takes, s: the membership record withdrawn (two etcd
    requests), the two HTTP APIs shut, the lender's last frees awaited, the transport closed
    (its connections' frames, then its inbound connections, each within a frame timeout)."""
    t = config.timeouts
    # etcd: the lease revoked, then the client closed; a few seconds for the tasks cancelled.
    return 2 * t.etcd_request_s + 2 * HTTP_SHUTDOWN_S + t.peer_request_s + 2 * frame_timeout_s + 5.0


def device_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a sticky device error (an illegal address, a device-side assert, a
    launch failure): every later CUDA call of the process fails too, so the instance must
    restart. Errors that leave the context usable (out of memory, a bad launch configuration)
    are not."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA error" in text and any(e in text for e in _STICKY_CUDA_ERRORS)


class MoveNotDone(ValueError):
    """An ordered move that moved nothing (the peer refused, the request's blocks could not
    move yet, a transfer failed): the gManager hears why and plans again from heartbeats."""


class InstanceDaemon:
    """Everything one instance runs. :meth:`run` is its whole life."""

    def __init__(self, config: InstanceConfig, notifier: SystemdNotifier | None = None,
                 gmanager_token: str | None = None) -> None:
        """``gmanager_token``: sent to the gManager's admin API over TCP (``read_gmanager_token``)."""
        self.config = config
        self.gmanager_token = gmanager_token
        self.notifier = notifier or SystemdNotifier()
        self.metrics = InstanceMetrics()
        self.peers = PeerDirectory(config.instance_id)
        self.membership = membership_for(config)  # the state folder, or etcd when endpoints are set
        self.fence = EpochFence()
        self.draining = False
        self._stopping = asyncio.Event()
        self._withdrawn = False  # the membership record is gone for good (the daemon stops)
        # When the engine loop last turned, and whether it waits for work now: the watchdog
        # pings only while it turns (a step stuck on a hung device keeps the event loop alive).
        self._engine_turned_at = time.monotonic()
        self._engine_idle = True
        self._watchdog_withheld = False
        self._engine_task: asyncio.Task | None = None
        self._member_runs: dict[int, tuple[str, int, int]] = {}  # instance id -> (host, pid, run) last seen
        # This process's run: new at each start, in its membership record and its holds and
        # reservations on peers (a pid may come again, a container's often does).
        self.run_id = random.randrange(1, 1 << 62)
        self._work = asyncio.Event()  # set when the engine may have something to do
        self._queues: dict[str, asyncio.Queue[GenerationEvent]] = {}
        self._request_ids = itertools.count(1)
        self._prompt_tokens: dict[str, int] = {}
        self._tokens_window: list[tuple[float, int]] = []
        self.engine: LLMEngine | None = None
        self.transport: Transport | None = None
        self.remote: TransportRemoteAttention | MailboxRemoteAttention | None = None
        self.step_server: StepServer | None = None
        self.lender: TransportLender | None = None
        self.http_port = 0  # the OpenAI API's port once listening
        self.heartbeats = HeartbeatState(config.instance_id)
        self._leader: tuple[int, PeerAddress] | None = None  # (epoch, address) of the gManager leader
        self._heartbeat_task: asyncio.Task | None = None
        # gManager moves wait here for the next step boundary, where block tables may change.
        self._ordered_moves: list[tuple[MoveKV, asyncio.Future[bool]]] = []
        # Home-block moves whose data a peer committed, to switch at the next step boundary.
        # Functions background moves run at the next step boundary (their table switches), with
        # the futures of their results.
        self._at_step_boundary: list[tuple[Callable[[], object], asyncio.Future]] = []
        self._moves_in_flight: set[asyncio.Task] = set()
        self._device_failure: BaseException | None = None  # a sticky device error: stop and exit 1
        self._pending_aborts: set[str] = set()  # requests whose clients left, ended at the next step boundary
        self._registered_once = False  # the first registration is done (before it, start-up is under way)
        self._peer_step_failures: dict[int, int] = {}  # cluster id -> steps failed in a row for its part
        self._connecting: dict[int, asyncio.Task] = {}  # cluster id -> connection being opened ahead of use
        # Audits of the segments held here for other homes: home -> when it was first seen
        # holding or last audited, and home -> its audit under way.
        self._audited_at: dict[int, float] = {}
        self._audits: dict[int, asyncio.Task] = {}
        # home -> the last (request, segment) its last audit named, where the next goes on (a home
        # with more segments here than one audit names has them audited in turns)
        self._audit_next: dict[int, tuple[int, int]] = {}
        self._frame_timeout_s = TransportConfig().frame_timeout_s  # the transport's bound on one frame's receive
        self.apb_inbox = APBInbox()  # passing blocks of the APB prefills this instance takes part in
        self._prefill_info: dict[str, dict[str, Any]] = {}  # request id -> how it was prefilled, for its first event

    # ---- life --------------------------------------------------------------------------
    async def run(self) -> None:
        """Start up, serve until SIGTERM (a second one forces exit), shut down cleanly."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_signal)
        loop.add_signal_handler(signal.SIGINT, self._on_signal)
        runners: list[web.AppRunner] = []
        tasks: list[asyncio.Task] = []
        stop = asyncio.create_task(self._stopping.wait())
        try:
            self.notifier.status("loading the model")
            # A stop asked for during start-up ends it after the stage under way (a model load
            # cannot be interrupted): no further stage, no registration, no READY.
            await self._start_engine_and_transport()
            if self._stopping.is_set():
                return
            runners = await self._start_http()
            if self._stopping.is_set():
                return
            self._publish()
            # READY only once peers and the gManager can see this instance.
            registration_s = 3 * self.config.timeouts.etcd_request_s
            registered = asyncio.create_task(self.membership.wait_published(self.config.instance_id, registration_s))
            await asyncio.wait([registered, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._stopping.is_set():
                registered.cancel()
                await asyncio.gather(registered, return_exceptions=True)
                return
            if not registered.result():
                raise StartupError(f"instance {self.config.instance_id} could not register within "
                                   f"{registration_s:g} s (three etcd request timeouts): is the discovery "
                                   "(etcd or the state directory) reachable?")
            self._registered_once = True
            self.notifier.ready(f"instance {self.config.instance_id} serving on {self.transport.address}")
            log.info("instance %d ready: peers at %s, HTTP on %s:%d, socket %s", self.config.instance_id,
                     self.transport.address, self.config.http_host, self.http_port, self.config.socket_path)
            self._engine_task = asyncio.create_task(self._engine_loop(), name="engine")
            tasks = [self._engine_task, asyncio.create_task(self._maintenance_loop(), name="maintenance")]
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
            if self._device_failure is not None:
                raise DeviceFailed(str(self._device_failure)) from self._device_failure
            await self._drain_for_stop()
            if self._device_failure is not None:  # during the drain: still a failure (systemd restarts it)
                raise DeviceFailed(str(self._device_failure)) from self._device_failure
        finally:
            # What follows is bounded (cleanup_budget_s); should the drain have used up the
            # unit's TimeoutStopSec margin, systemd waits for it rather than SIGKILL it midway.
            self.notifier.stopping("stopping", extend_timeout_s=cleanup_budget_s(self.config, self._frame_timeout_s))
            self._withdrawn = True  # a drain asked for from here on must not publish the record again
            self.membership.withdraw(self.config.instance_id)
            if self._heartbeat_task is not None:
                tasks.append(self._heartbeat_task)
            # Moves still in flight stop here: their requests end below, which aborts them, and
            # a peer's reservation expires (or, committed, is freed when this debtor is lost).
            tasks.extend(self._moves_in_flight)
            tasks.extend(self._connecting.values())
            tasks.extend(self._audits.values())
            for task in (stop, *tasks):
                task.cancel()
            await asyncio.gather(stop, *tasks, return_exceptions=True)
            if self.engine is not None and self.engine.has_unfinished:
                # With the engine stopped: ending them frees their segments on creditors (the
                # lender's FreeSegment sends, awaited by lender.close below) rather than leaving
                # them until the creditors' debtor_lost_s, and tells their clients.
                self._fail_running("the instance stopped before they finished")
            await self.membership.close()  # etcd: revoking the lease deletes the record at once
            for runner in runners:
                await runner.cleanup()
            if self.lender is not None:
                await self.lender.close()
            if isinstance(self.remote, MailboxRemoteAttention):
                await self.remote.close()
            if self.step_server is not None:
                self.step_server.close_all()
            if self.transport is not None:
                await self.transport.close()
            log.info("instance %d stopped", self.config.instance_id)

    def _on_signal(self) -> None:
        if self._stopping.is_set():
            log.warning("second stop signal: exiting now")
            os._exit(1)
        log.info("stop signal: admitting no new requests; handing over KV held for others and finishing "
                 "running requests (at most %.0f s)", self.config.timeouts.drain_s)
        # A second SIGTERM ends the process in the kernel: a handler of the event loop runs only
        # when the loop turns, which a thread blocked in a device call never lets it do.
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        self.draining = True
        self._stopping.set()

    async def _drain_for_stop(self) -> None:
        """Stop admitting, then wait, at most ``timeouts.drain_s`` seconds, until this instance
        holds nothing for other homes (a gManager drain moves it elsewhere) and its own requests
        have finished (they run on: their clients are connected here). What is left at the
        deadline is logged; the segments still held are lost to their homes."""
        self.draining = True
        self._publish()  # at once, so that peers stop spilling here before the next tick
        self.notifier.stopping("handing over KV held for others, finishing running requests")
        timeouts = self.config.timeouts
        started = time.monotonic()
        deadline = started + timeouts.drain_s
        handover = HandOver(self.config.instance_id, lambda: find_leader_admin(self.config, self.membership),
                            request_timeout_s=timeouts.peer_request_s, token=self.gmanager_token,
                            retry_s=max(1.0, 2 * timeouts.heartbeat_interval_s))  # a 404 clears after a heartbeat
        held_at_start = blocks_held_by_home(self.ledger)
        if held_at_start:
            log.info("hand-over: holding %s", describe_held(held_at_start))
        while True:
            held = blocks_held_by_home(self.ledger)
            if not held and not self.engine.has_unfinished:
                break
            now = time.monotonic()
            if now >= deadline:
                break
            if self._engine_task is not None and self._engine_task.done():
                log.error("the engine loop ended during the stop: its requests cannot finish")
                break
            if held:
                await handover.ask_if_due(now, deadline, describe_held(held))
            self._work.set()
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - started
        if held:
            log.warning("stop deadline (drain_s %.0f s) passed holding %s: lost to their homes, whose requests "
                        "fail (hand-over: %s)", timeouts.drain_s, describe_held(held), handover.summary())
        elif held_at_start or handover.last_answer is not None:
            log.info("hand-over done after %.1f s: nothing held for other instances", elapsed)
        num_unfinished = len(self.engine.scheduler.requests)
        if num_unfinished:
            log.warning("stop deadline (drain_s %.0f s) passed with %d requests of this instance unfinished: "
                        "they end with an error", timeouts.drain_s, num_unfinished)
        elif not held:
            log.info("ready to stop after %.1f s: no running request, nothing held for others", elapsed)

    # ---- start-up ------------------------------------------------------------------------
    async def _start_engine_and_transport(self) -> None:
        from infinite_llm.transport.ucx import UcxTransport

        c = self.config
        # Before the model loads: an instance that cannot reach its cluster's etcd says so at once
        # (EtcdUnreachable, a bounded wait) rather than after a long load.
        await self.membership.start()
        checkpoint = await asyncio.to_thread(load_checkpoint, c.model, show_progress=True)
        mc = checkpoint.config
        device = torch.device(c.device)
        if device.type == "cuda" and device.index is not None:
            # The event loop's thread runs the steps and serves attend requests: Triton launches
            # and CUDA graph replays go to the thread's current device, which must be ours.
            torch.cuda.set_device(device)
        dtype = c.dtype if c.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
        block_bytes = mc.num_layers * 2 * c.block_size * mc.num_kv_heads * mc.head_dim * _DTYPE_BYTES[dtype]
        pool_blocks = c.kv_pool_blocks or (c.kv_pool_bytes // block_bytes if c.kv_pool_bytes else 2048)
        if pool_blocks < 1:
            raise ValueError(f"kv_pool_bytes {c.kv_pool_bytes} holds no block of {block_bytes} bytes")
        transport_config = TransportConfig(
            host=c.peer_host, port=c.peer_port, spin_s=peer_spin_for(c.peer_spin_s, device.type),
            connect_timeout_s=c.timeouts.connect_s,
            request_timeout_s=c.timeouts.peer_request_s, receive_device=c.device if device.type == "cuda" else "cpu",
            land_inline_on_host=device.type == "cuda", shared_memory_bytes=c.peer_shared_memory_bytes,
            shared_memory_dir=str(c.peer_shared_memory_dir), header_ring_bytes=c.peer_header_ring_bytes,
            device_pools=c.peer_device_pools, pull_graphs=c.peer_pull_graphs)
        self._frame_timeout_s = transport_config.frame_timeout_s
        self.transport = UcxTransport(transport_config)
        self.remote = TransportRemoteAttention(self.transport, self.peers, c.block_size, self.metrics,
                                               c.timeouts.peer_request_s)
        if c.remote_attention == "mailboxes" or (c.remote_attention == "auto" and device.type == "cuda"):
            self.remote = MailboxRemoteAttention(
                self.remote, self.transport, self.peers, num_layers=mc.num_layers, num_heads=mc.num_heads,
                head_dim=mc.head_dim, dtype=_TORCH_DTYPE[dtype], device=device, max_rows=c.max_num_seqs,
                timeout_s=c.timeouts.peer_request_s, host_id=host_id(), steps_ahead=c.steps_ahead,
                nccl_links=c.nccl_links)
        self.lender = TransportLender(self.transport, self.peers, self.metrics, c.timeouts.peer_request_s,
                                       share_kv=c.share_kv)
        self.lender.run_id = self.run_id
        self.lender.hold_renew_s = c.timeouts.kv_hold_s / 3
        engine_config = EngineConfig(block_size=c.block_size, pool_blocks=(pool_blocks,), max_num_seqs=c.max_num_seqs,
                                     queue_bypass_limit=c.queue_bypass_limit,
                                     split_decode_interval=c.split_decode_interval,
                                     max_num_batched_tokens=c.max_num_batched_tokens, device=c.device, dtype=dtype,
                                     spill_to_creditors=False)
        self.engine = await asyncio.to_thread(LLMEngine, checkpoint, engine_config, self.remote, self.lender)
        self.lender.engine = self.engine
        self.lender.prepare(self.pool)  # before any step: making a CUDA stream waits for queued work
        self.served_model = c.served_model_name or Path(checkpoint.source).stem
        bm = self.engine.block_manager
        self.ledger = CreditorLedger(bm.reserve_home_blocks, bm.release_home_blocks,
                                     reservation_ttl_s=c.timeouts.reservation_s, hold_ttl_s=c.timeouts.kv_hold_s,
                                     first_reservation_id=random.randrange(1, 1 << 62))
        self.lender.kept_for_others = lambda: self.ledger.num_blocks_on_hold
        self.lender.wake = self._work.set
        self.creditor = CreditorAttention(self.ledger, self.pool, mc.num_heads,
                                           host_staging_bytes=transport_config.limits.inline_cuda_limit_bytes,
                                           cuda_graphs=c.creditor_cuda_graphs)
        # The step protocol's creditor side plans with a CreditorAttention of its own: its plans'
        # tables are written on the mailboxes' streams, behind their steps.
        self.step_server = StepServer(CreditorAttention(self.ledger, self.pool, mc.num_heads, cuda_graphs=False),
                                      host_id=host_id(), timeout_s=c.timeouts.peer_request_s,
                                      host_dir=c.peer_shared_memory_dir, cuda_graphs=c.creditor_cuda_graphs,
                                      nccl_links=c.nccl_links != "never")
        self.metrics.watch_creditor(self.creditor)
        self.metrics.watch_transport(self.transport)
        self.block_nbytes = self.pool[0].numel() * self.pool.element_size()
        await self.transport.start(self._handle, self._place)

    async def _start_http(self) -> list[web.AppRunner]:
        c = self.config
        runners = []
        # handler_cancellation: a client that goes away cancels its handler, whose generator
        # then aborts the request (otherwise a non-streaming request ran on to its end).
        local = web.AppRunner(LocalApp(self, admin_group_id(c.admin_group)).build(), handler_cancellation=True,
                              shutdown_timeout=HTTP_SHUTDOWN_S)
        await local.setup()
        await start_local_site(local, Path(c.socket_path), c.admin_group)
        runners.append(local)
        if c.http_port is not None:
            api = web.AppRunner(OpenAIApp(self).build(), handler_cancellation=True, shutdown_timeout=HTTP_SHUTDOWN_S)
            await api.setup()
            site = web.TCPSite(api, c.http_host, c.http_port)
            await site.start()
            self.http_port = site._server.sockets[0].getsockname()[1]
            runners.append(api)
        return runners

    @property
    def pool(self) -> torch.Tensor:
        return self.engine.pools[self.engine.home_instance_id]

    # ---- the engine ----------------------------------------------------------------------
    async def _engine_loop(self) -> None:
        engine = self.engine
        idle_s = 0.0  # back-off while no request can be scheduled for want of blocks
        while True:
            self._engine_turned_at = time.monotonic()
            self._engine_idle = False
            for request_id in self._pending_aborts:
                if request_id in engine.scheduler.requests:  # not finished meanwhile
                    self.metrics.requests_finished.labels(reason="abort").inc()
                engine.abort(request_id)
            self._pending_aborts.clear()
            await self._carry_out_ordered_moves()
            if not engine.has_unfinished:
                if isinstance(self.remote, MailboxRemoteAttention):
                    self.remote.stand_down_all(engine.last_step_id)  # no step of its queued ahead comes
                self._work.clear()
                self._engine_idle = True
                await self._work.wait()
                continue
            try:
                outputs = await engine.step_async()
            except PeerPartFailed as exc:
                if self._peer_part_failed(exc):
                    # A short pause before the same step again: a peer that is reconnecting or
                    # busy in a long step of its own needs it; failures take milliseconds.
                    await asyncio.sleep(PEER_RETRY_PAUSE_S * self._peer_step_failures.get(exc.inst_id, 1))
                continue
            except Exception as exc:  # noqa: BLE001  a failed step ends its requests, not the daemon
                if device_failed(exc):
                    self._device_failed(exc)
                    self._fail_running(f"the device failed: {exc}")
                    raise DeviceFailed(str(exc)) from exc
                log.exception("engine step failed; ending the running requests")
                self._fail_running(f"{type(exc).__name__}: {exc}")
                continue
            if self._peer_step_failures:
                self._peers_answered(outputs)
            if self.engine.recovered:
                self._note_recovered()
            if not outputs and not engine.scheduler.running:
                idle_s = min(0.5, max(0.01, 2 * idle_s))
                self._work.clear()
                try:
                    await asyncio.wait_for(self._work.wait(), timeout=idle_s)
                except TimeoutError:
                    pass
                continue
            idle_s = 0.0
            now = time.monotonic()
            num_new = 0
            for out in outputs:
                num_new += len(out.new_token_ids)
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(GenerationEvent(
                        out.request_id, out.new_text, out.new_token_ids, out.finished, out.finish_reason,
                        self._prompt_tokens.get(out.request_id, 0), out.num_output_tokens))
                if out.finished:
                    self.metrics.requests_finished.labels(reason=out.finish_reason or "stop").inc()
            self.metrics.generated_tokens.inc(num_new)
            self._tokens_window.append((now, num_new))
            # Give peers' attend requests and the HTTP servers a turn between steps.
            await asyncio.sleep(0)

    def _device_failed(self, exc: BaseException) -> None:
        """A CUDA error of this kind sticks to the process: no later kernel can run. Stop at
        once (no drain: nothing can be computed or sent from the device any more) and exit with
        an error, so that the service manager starts this instance afresh."""
        if self._device_failure is None:
            log.critical("the device failed: ending the running requests and exiting", exc_info=exc)
            self._device_failure = exc
            self._stopping.set()

    def _peer_part_failed(self, exc: PeerPartFailed) -> bool:
        """A creditor's part of the step did not come. The step kept nothing, so it runs again
        (True); after ``PEER_STEP_RETRIES`` failures in a row, or at once if the peer has left
        the cluster, the peer counts as lost: the requests with KV there recompute it and the
        others go on (False)."""
        failures = self._peer_step_failures.get(exc.inst_id, 0) + 1
        self._peer_step_failures[exc.inst_id] = failures
        gone = exc.inst_id not in self.membership.members()
        if failures < PEER_STEP_RETRIES and not gone:
            log.warning("step retried: the part of instance %d failed (%d in a row): %s", exc.inst_id, failures, exc.error)
            return True
        self._peer_step_failures.pop(exc.inst_id, None)
        self._recover_from_lost_peer(exc.inst_id, exc.engine_id, gone,
                                     f"{'left the cluster' if gone else f'failed {failures} steps in a row'}: {exc.error}")
        return False

    def _recover_from_lost_peer(self, inst_id: int, engine_id: int, gone: bool, why: str) -> None:
        """The KV that instance ``inst_id`` held for this home's requests is lost: they recompute
        it from their token ids (``LLMEngine.recover_lost``), into home blocks that later spills
        move on to peers with room; those whose lost KV the cluster cannot hold end with an
        error. A peer still in the membership (alive but failing) is told to free the segments."""
        self.peers.quarantine(inst_id, time.monotonic() + LOST_PEER_QUARANTINE_S)
        lost = self.engine.recover_lost(engine_id, blocks_elsewhere=self.lender.num_blocks_elsewhere())
        if not lost.segments:
            return
        if not gone:
            for request_id, segments in lost.segments.items():
                for segment in segments:
                    self.lender.release(request_id, segment)
        if lost.unrecoverable:
            self._fail_requests(list(lost.unrecoverable),
                                f"instance {inst_id}, which held part of their KV, {why}; the cluster has no room "
                                "to recompute it")
        if lost.recomputing:
            log.warning("instance %d, which held part of the KV of %d requests, %s: they recompute %d tokens",
                        inst_id, len(lost.recomputing), why, sum(lost.recomputing.values()))

    def _note_recovered(self) -> None:
        """Count the requests whose lost KV is recomputed (they decode again)."""
        while self.engine.recovered:
            done = self.engine.recovered.popleft()
            self.metrics.segments_recomputed.inc(done.num_segments)
            self.metrics.tokens_recomputed.inc(done.num_tokens)
            self.metrics.recompute_seconds.observe(done.seconds)
            log.info("request %s recomputed %d tokens of %d lost segments in %.2f s: it decodes again",
                     done.request_id, done.num_tokens, done.num_segments, done.seconds)

    def _peers_answered(self, outputs) -> None:
        """A step completed: the peers that held KV of the requests it advanced answered their
        parts, so their failures in a row end. A peer the step did not use keeps its count: steps
        without it say nothing of it."""
        bm = self.engine.block_manager
        used = {segment.instance_id for out in outputs if bm.has_request(out.request_id)
                for segment in bm.block_table(out.request_id)}
        for inst_id in list(self._peer_step_failures):
            try:
                engine_id = self.peers.by_inst(inst_id).engine_id
            except KeyError:
                continue
            if engine_id in used:
                del self._peer_step_failures[inst_id]

    def _fail_running(self, reason: str) -> None:
        self._fail_requests(list(self.engine.scheduler.requests), reason)

    def _fail_requests(self, request_ids: list[str], reason: str) -> None:
        for request_id in request_ids:
            request = self.engine.scheduler.requests.get(request_id)
            num_output = len(request.output_token_ids) if request is not None else 0
            if request is not None:
                self.metrics.requests_finished.labels(reason="error").inc()
            self.engine.abort(request_id)
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(GenerationEvent(request_id, "", (), True, "error",
                                                 self._prompt_tokens.get(request_id, 0), num_output))
        log.error("%d requests ended: %s", len(request_ids), reason)

    def _refuse_while_draining(self) -> None:
        if self.draining:
            raise RequestRefused("this instance is draining and admits no new requests", status=503)
        if self._registered_once and not self.membership.registered():
            # Cut off from the cluster's etcd for a lease: the others have dropped this instance,
            # no peer lends to it or counts on it, and a request here would compete with the
            # cluster for nothing. It takes work again once it registers again.
            raise RequestRefused("this instance lost its cluster membership (its etcd lease expired): it admits "
                                 "no new requests until it registers again", status=503)

    async def generate(self, prompt: str | tuple[int, ...] | None, messages: Sequence[dict[str, str]] | None,
                       params: SamplingParams, refuse_past_context: bool = False,
                       prefill: PrefillOptions | None = None) -> AsyncIterator[GenerationEvent]:
        self._refuse_while_draining()
        prefill = prefill or PrefillOptions()
        request_id = str(next(self._request_ids))
        source: Any = prompt if prompt is not None else list(messages or ())
        try:
            # On a thread: a prompt of megabytes takes seconds to render and tokenize, and this
            # event loop serves peers' attend requests, heartbeats and the watchdog meanwhile.
            token_ids, doc_len = await asyncio.to_thread(self._prompt_and_document, source, prefill)
            self._refuse_while_draining()  # a drain may have begun while the prompt was tokenized
            context = self.engine.max_model_len
            if refuse_past_context and len(token_ids) + params.max_tokens > context:
                if len(token_ids) >= context:  # the prompt alone: max_tokens is not what to change
                    raise RequestRejected(
                        f"the prompt is too long: {len(token_ids)} tokens. This model's maximum context length is "
                        f"{context} tokens, and the prompt leaves no room for the {params.max_tokens} tokens asked for")
                raise RequestRejected(
                    f"max_tokens is too large: {params.max_tokens}. This model's maximum context length is "
                    f"{context} tokens and the request has {len(token_ids)} input tokens "
                    f"({params.max_tokens} > {context} - {len(token_ids)})")
            adopted = False
            if prefill.apb:
                if len(token_ids) >= context:  # refused before any instance works on it
                    raise RequestRejected(f"the prompt has {len(token_ids)} tokens; the model's context is {context} "
                                          "tokens and at least one must be left for the output")
                adopted = await self._prefill_apb(request_id, token_ids, doc_len, params, prefill)
            if not adopted:
                self.engine.add_request(token_ids, params, request_id=request_id)
        except RequestRejected as exc:
            raise RequestRefused(str(exc)) from None
        except BaseException:
            self._prefill_info.pop(request_id, None)
            raise
        num_prompt = len(self.engine.scheduler.requests[request_id].prompt_token_ids)
        self._prompt_tokens[request_id] = num_prompt
        self.metrics.prompt_tokens.inc(num_prompt)
        queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._queues[request_id] = queue
        self._work.set()
        finished = False
        try:
            info = self._prefill_info.pop(request_id, None)
            while not finished:
                event = await queue.get()
                finished = event.finished
                if info is not None:
                    event, info = dataclasses.replace(event, prefill=info), None
                yield event
        finally:
            if not finished:
                # The client went away. The engine may be inside a step that holds this request
                # (a step awaits its creditors' parts): the abort waits for the step boundary.
                self._pending_aborts.add(request_id)
                self._work.set()
            self._queues.pop(request_id, None)
            self._prompt_tokens.pop(request_id, None)

    # ---- APB prefill (docs/apb.md) ----------------------------------------------------------
    def _prompt_and_document(self, source: Any, prefill: PrefillOptions) -> tuple[list[int], int]:
        """The request's token ids and how many of them are the document, the query after it.

        A completion's query is ``prefill.query``, after the prompt; a chat's, with APB, is its
        last user turn and what the template puts after it (the turn's end, the assistant's
        header), each side tokenized on its own. Without a query the document is the prompt."""
        engine = self.engine
        if isinstance(source, list) and source and all(isinstance(m, dict) for m in source):
            token_ids = engine.prompt_token_ids(source)
            if not prefill.apb:
                return token_ids, len(token_ids)
            users = [m for m in source if m.get("role") == "user" and m.get("content")]
            text = engine.tokenizer.apply_chat_template(source)
            cut = text.rfind(users[-1]["content"]) if users else -1
            if cut <= 0:
                return token_ids, len(token_ids)
            doc = engine.tokenizer.encode(text[:cut], add_special_tokens=False)
            query = engine.tokenizer.encode(text[cut:], add_special_tokens=False)
            return doc + query, len(doc)
        doc = engine.prompt_token_ids(source)
        if prefill.query is None:
            return doc, len(doc)
        query = (engine.tokenizer.encode(prefill.query, add_special_tokens=False) if isinstance(prefill.query, str)
                 else list(prefill.query))
        return doc + query, len(doc)

    async def _prefill_apb(self, request_id: str, token_ids: list[int], doc_len: int, params: SamplingParams,
                           options: PrefillOptions) -> bool:
        """Prefill the document over H instances with APB and queue the request over the KV they
        made (``engine.add_prefilled_request``); True once it is queued. False: it is prefilled
        exactly instead (the document too short, too few blocks, a host that failed), with the
        reason in the request's prefill note. RequestRefused (400) for more hosts than are live."""
        c = self.config
        peers = self.peers.creditors() if c.share_kv else []
        live = len(peers) + 1
        num_hosts = options.hosts if options.hosts is not None else live
        if num_hosts > live:
            raise RequestRefused(f"apb_hosts is {num_hosts}, but {live} instances can take part now (this one and "
                                 f"{len(peers)} live peers that take KV blocks)", status=400)
        started = time.perf_counter()

        def exact(note: str) -> bool:
            log.info("request %s: APB prefill not done (%s): prefilled exactly", request_id, note)
            self._prefill_info[request_id] = {"mode": "exact", "requested": "apb", "note": note}
            self.metrics.apb_prefills.labels(result="exact").inc()
            return False

        if not c.share_kv:
            return exact("this instance does not share KV (share_kv = false), so no peer may hold its chunks")
        # Without a query the document's last token is computed again, exactly, as the request's
        # first step: that step samples the first token.
        num_computed = doc_len if doc_len < len(token_ids) else doc_len - 1
        plan = plan_apb(num_computed, num_hosts, c.block_size, min_chunk_tokens=c.apb_min_chunk_tokens,
                        anchor_tokens=options.anchor_tokens, passing_tokens=options.passing_tokens)
        if isinstance(plan, str):
            return exact(plan)
        hosts = peers[:num_hosts - 1]  # the most free blocks first; the home takes the last chunk
        try:
            outcome = await self._run_apb(request_id, token_ids, doc_len, num_computed, plan, hosts, options)
        except (APBAborted, TransportError, TimeoutError, ValueError) as exc:
            return exact(f"the APB prefill failed: {exc}")
        except torch.OutOfMemoryError as exc:
            # A whole chunk's activations at once did not fit beside the pool: the exact
            # prefill's chunks of max_num_batched_tokens may (their blocks were given back).
            torch.cuda.empty_cache()
            return exact(f"the APB prefill ran out of device memory on this instance: {str(exc).splitlines()[0]}")
        segments, passing_bytes = outcome
        try:
            self.engine.add_prefilled_request(token_ids, params, request_id, segments, num_computed)
        except BaseException:
            self._give_up_apb_segments(request_id, segments)
            raise
        finally:
            for rank, peer in enumerate(hosts):
                self.lender.stop_counting_on(request_id, plan.chunk(rank)[0], peer)
        seconds = time.perf_counter() - started
        self.metrics.apb_prefills.labels(result="apb").inc()
        self._prefill_info[request_id] = {
            "mode": "apb",
            "hosts": [{"instance": inst_id, "tokens": list(plan.chunk(rank))}
                      for rank, inst_id in enumerate([p.inst_id for p in hosts] + [c.instance_id])],
            "anchor_tokens": plan.anchor_len, "passing_tokens": plan.passing_len, "passing_bytes": passing_bytes,
            "seconds": round(seconds, 6), "note": None,
        }
        log.info("request %s: APB prefill of %d tokens over instances %s in %.3f s", request_id, num_computed,
                 [p.inst_id for p in hosts] + [c.instance_id], seconds)
        return True

    async def _run_apb(self, request_id: str, token_ids: list[int], doc_len: int, num_computed: int, plan: APBPlan,
                       hosts: list[Peer], options: PrefillOptions) -> tuple[list[Segment], int]:
        """Reserve every host's blocks, run the hosts' chunks at once, and return the request's
        segments (peers' held copies, then the home's blocks) and the passing bytes sent. On any
        failure every block taken is given back before the error is raised."""
        c = self.config
        bs = c.block_size
        own = c.instance_id
        num_hosts = plan.num_hosts
        home_rank = num_hosts - 1
        timeout_s = c.timeouts.peer_request_s
        total_s = (self.engine.model_config.num_layers + 2) * timeout_s
        query = token_ids[doc_len:] if num_computed == doc_len else [token_ids[doc_len - 1]]
        # With no query, the last document token (computed again as the request's first step)
        # scores the passing blocks in its stead.
        key = (own, int(request_id))
        segments: list[Segment] = []
        home_ids: list[int] | None = None
        reservations: dict[int, int] = {}  # rank -> reservation id
        peer_blocks: dict[int, tuple[int, ...]] = {}  # rank -> the blocks reserved there
        counted: list[tuple[int, Peer]] = []

        async def reserve(rank: int, peer: Peer) -> None:
            num_blocks = -(-plan.chunk_len(rank) // bs)
            reply = await self.transport.request(peer.address, TryMoveKV(
                epoch=0, move_id=self.lender.next_move_id(), req_id=int(request_id), home_inst_id=own, src_inst_id=own,
                num_blocks=num_blocks, block_nbytes=self.block_nbytes, home_run=self.run_id), timeout_s=timeout_s)
            if isinstance(reply, MoveRejected):
                peer.num_blocks_free = reply.num_blocks_free
                raise ValueError(f"instance {peer.inst_id} has no room for chunk {rank} ({num_blocks} blocks): "
                                 f"{reply.reason.name.lower()}, {reply.num_blocks_free} blocks free there")
            if not isinstance(reply, MoveReserved) or len(reply.dst_block_ids) != num_blocks:
                raise ValueError(f"instance {peer.inst_id} answered a reservation of {num_blocks} blocks with {reply!r}")
            reservations[rank] = reply.reservation_id
            peer_blocks[rank] = tuple(reply.dst_block_ids)
            self.lender.count_on(request_id, plan.chunk(rank)[0], peer)
            counted.append((rank, peer))

        def chunk_message(rank: int) -> APBChunkPrefill:
            start, end = plan.chunk(rank)
            ids = (token_ids[:plan.anchor_len] if rank else []) + query + token_ids[start:end]
            return APBChunkPrefill(
                home_inst_id=own, req_id=int(request_id), home_run=self.run_id, rank=rank,
                host_inst_ids=tuple(p.inst_id for p in hosts) + (own,), reservation_id=reservations.get(rank, 0),
                token_start=start, anchor_len=plan.anchor_len, query_len=len(query), chunk_len=end - start,
                passing_len=plan.passing_len, pool_width=7, observe_len=32, scorer=options.scorer,
                seed=int(request_id), layer_timeout_ms=int(timeout_s * 1000),
                token_ids=torch.tensor(ids, dtype=torch.int64))

        async def peer_chunk(rank: int, peer: Peer) -> APBChunkDone:
            message = chunk_message(rank)
            reply = await self.transport.request(peer.address, message, timeout_s=total_s)
            if (not isinstance(reply, APBChunkDone) or reply.reservation_id != message.reservation_id
                    or reply.num_tokens != message.chunk_len):
                raise ValueError(f"instance {peer.inst_id} answered chunk {rank} with {reply!r}")
            return reply

        self.apb_inbox.begin(key, num_hosts, home_rank, 1 + self.engine.model_config.num_layers)
        group = TransportHostGroup(self.transport, self.apb_inbox, key, home_rank,
                                   [p.address for p in hosts] + [None], self.engine.device, timeout_s)
        try:
            await asyncio.gather(*(reserve(rank, peer) for rank, peer in enumerate(hosts)))
            home_start, home_end = plan.chunk(home_rank)
            home_ids = self.engine.block_manager.reserve_home_blocks(-(-(home_end - home_start) // bs))
            if home_ids is None:
                raise ValueError(f"this instance has too few free blocks for its chunk ({home_end - home_start} tokens)")
            tasks = [asyncio.ensure_future(peer_chunk(rank, peer)) for rank, peer in enumerate(hosts)]
            tasks.append(asyncio.ensure_future(prefill_chunk(self.engine.model, group, chunk_message(home_rank),
                                                             self.pool, home_ids, bs)))
            try:
                done, pending = await asyncio.wait(tasks, timeout=total_s, return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t for t in done if t.exception() is not None), None)
                if failed is not None or pending:
                    why = str(failed.exception()) if failed is not None else f"not done within {total_s:.0f} s"
                    self.apb_inbox.fail(key, why)  # the home's own chunk stops waiting at once
                    if failed is not None:
                        raise failed.exception()
                    raise TimeoutError(why)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            replies = [t.result() for t in tasks[:-1]]
            for rank, peer in enumerate(hosts):
                start, end = plan.chunk(rank)
                segments.append(Segment(peer.engine_id, peer_blocks[rank], start, end - start,
                                        copy_id=reservations[rank]))
            segments.append(Segment(self.engine.home_instance_id, tuple(home_ids), home_start,
                                    num_computed - home_start))
            return segments, group.bytes_sent + sum(r.passing_bytes for r in replies)
        except BaseException:
            if home_ids is not None:
                self.engine.block_manager.release_home_blocks(home_ids)
            for rank, peer in counted:
                self.lender.free_copy(peer, request_id, plan.chunk(rank)[0] // bs, reservations[rank])
                self.lender.stop_counting_on(request_id, plan.chunk(rank)[0], peer)
            raise
        finally:
            self.apb_inbox.end(key)

    def _give_up_apb_segments(self, request_id: str, segments: list[Segment]) -> None:
        """The request was not queued over its APB segments: every host frees its chunk."""
        bs = self.config.block_size
        for segment in segments:
            if segment.instance_id == self.engine.home_instance_id:
                self.engine.block_manager.release_home_blocks(segment.block_ids)
            else:
                self.lender.free_copy(self.peers.by_engine(segment.instance_id), request_id,
                                      segment.token_start // bs, segment.copy_id)

    async def _serve_apb_chunk(self, message: APBChunkPrefill) -> APBChunkDone:
        """A home's APB prefill: compute chunk ``message.rank`` into the blocks it reserved here,
        meeting the other hosts per layer; the chunk's KV is then the request's segment held here.
        ValueError (an error reply) for a request that does not fit what this instance holds for
        it; on any failure the reservation is given up."""
        c = self.config
        own = c.instance_id
        self._note_home_run(message.home_inst_id, message.home_run)
        reservation = self.ledger.reservation(message.reservation_id)  # LedgerError: not here (or expired)
        if (reservation.home_inst_id, reservation.req_id) != (message.home_inst_id, message.req_id):
            raise ValueError(f"reservation {message.reservation_id} is for request {reservation.req_id} of instance "
                             f"{reservation.home_inst_id}")
        if message.token_start % c.block_size:
            raise ValueError(f"chunk start {message.token_start} is not on a block of {c.block_size} tokens")
        if len(reservation.block_ids) != -(-message.chunk_len // c.block_size):
            raise ValueError(f"reservation {message.reservation_id} has {len(reservation.block_ids)} blocks, a chunk "
                             f"of {message.chunk_len} tokens takes {-(-message.chunk_len // c.block_size)}")
        if message.host_inst_ids[message.rank] != own:
            raise ValueError(f"rank {message.rank} is instance {message.host_inst_ids[message.rank]}, not {own}")
        vocab = self.engine.model_config.vocab_size
        ids = torch.as_tensor(message.token_ids)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ValueError(f"token ids outside the vocabulary [0, {vocab})")
        try:
            addresses = [None if inst_id == own else self.peers.by_inst(inst_id).address
                         for inst_id in message.host_inst_ids]
        except KeyError as exc:
            raise ValueError(f"host {exc} of the prefill is not a known peer") from None
        key = (message.home_inst_id, message.req_id)
        timeout_s = message.layer_timeout_ms / 1000
        self.apb_inbox.begin(key, len(addresses), message.rank, 1 + self.engine.model_config.num_layers)
        group = TransportHostGroup(self.transport, self.apb_inbox, key, message.rank, addresses, self.engine.device,
                                   timeout_s)

        def hold(layer: int) -> None:  # the blocks are written into: no expiry before the layer ends
            self.ledger.hold_while_receiving(message.reservation_id, time.monotonic() + timeout_s)

        try:
            result = await prefill_chunk(self.engine.model, group, message, self.pool, reservation.block_ids,
                                         c.block_size, before_layer=hold)
            self.ledger.landed(message.reservation_id)
            self.ledger.commit(message.reservation_id, message.home_inst_id, message.req_id,
                               message.token_start // c.block_size, time.monotonic())
        except BaseException:
            try:
                self.ledger.landed(message.reservation_id)
            except LedgerError:
                pass  # nothing was written yet, or the home gave it up: released either way below
            self.ledger.cancel(message.reservation_id)
            raise
        finally:
            self.apb_inbox.end(key)
        self.ledger.heard_from(message.home_inst_id, time.monotonic())
        return APBChunkDone(message.req_id, message.reservation_id, result.num_tokens, result.passing_bytes,
                            int(result.compute_s * 1000))

    # ---- serving peers -----------------------------------------------------------------------
    def _handle(self, message: Message) -> Message | None | Awaitable[Message | None]:
        """The transport's handler. Answers at once (inline, no task: an attend request is on
        the critical path of another instance's step), except commands that wait on this
        engine's step boundary or on peers, returned as awaitables that run as tasks."""
        if isinstance(message, AttendRequest):
            self.ledger.heard_from(message.home_inst_id, time.monotonic())
            started = time.perf_counter()
            try:
                result = self.creditor.attend(message)
            except Exception as exc:
                if device_failed(exc):
                    self._device_failed(exc)
                raise
            self.metrics.observe_attend_serve(time.perf_counter() - started)
            return result
        if isinstance(message, (StepBegin, StepStandDown, StepMailboxOpen, StepMailboxClose)):
            if isinstance(message, StepBegin):
                self.ledger.heard_from(message.home_inst_id, time.monotonic())
            try:
                return self.step_server.handle(message)
            except Exception as exc:
                if device_failed(exc):
                    self._device_failed(exc)
                raise
        if isinstance(message, TryMoveKV):
            reply = self._try_move(message)
            if isinstance(reply, MoveReserved):
                failpoints.reached("move.reserved")
            return reply
        if isinstance(message, HoldKV):
            self._note_home_run(message.home_inst_id, message.home_run)
            now = time.monotonic()
            if self.draining:  # it takes no spill: blocks kept here would be counted on in vain
                held = self.ledger.set_hold(message.home_inst_id, message.req_id, 0, 0, now)
            elif message.renew:
                held = self.ledger.renew_hold(message.home_inst_id, message.req_id, now)
            else:
                held = self.ledger.set_hold(message.home_inst_id, message.req_id, message.num_blocks,
                                            self._free_for_others(), now)
            return KVHoldReply(held, self._free_for_others())
        if isinstance(message, KVBlocks):
            # The data is already in the reserved blocks (the placer checked the runs against the
            # reservation and put it there); a reservation given up meanwhile is released now.
            reservation = self.ledger.landed(message.reservation_id)
            if message.commit_segment_id >= 0:  # the home's own move: committed with its data
                self.ledger.commit(message.reservation_id, reservation.home_inst_id, reservation.req_id,
                                   message.commit_segment_id, time.monotonic())
            failpoints.reached("move.stored")
            return KVBlocksStored(message.move_id, message.reservation_id, sum(r.num_blocks for r in message.runs))
        if isinstance(message, MoveCommit):
            self.ledger.commit(message.reservation_id, message.home_inst_id, message.req_id, message.segment_id,
                               time.monotonic())
            failpoints.reached("move.committed")
            return None
        if isinstance(message, FreeSegment):
            if not self.ledger.free_segment(message.home_inst_id, message.req_id, message.segment_id,
                                            message.reservation_id):
                held = self.ledger.held.get((message.home_inst_id, message.req_id, message.segment_id))
                if held is not None:  # a late free of an earlier copy: the newer one stays
                    log.info("instance %d's free of copy %d of request %d's segment %d came after copy %d was "
                             "committed there: kept", message.home_inst_id, message.reservation_id, message.req_id,
                             message.segment_id, held.reservation_id)
            # The kept plan (and its graphs) stays while the home has KV here: the next request
            # finds the change in the ledger and is planned over what is held then.
            if not self.ledger.has_segments_of(message.home_inst_id):
                self.creditor.forget(message.home_inst_id)
            return None
        if isinstance(message, (MoveKV, Drain, Uncordon, ForwardSegment)):
            if not self.fence.admit(message.epoch):
                self.metrics.stale_epoch_commands.inc()
                self.metrics.moves.labels(result="stale_epoch").inc()
                return ErrorReply(ErrorCode.STALE_EPOCH,
                                  f"epoch {message.epoch} is older than {self.fence.newest_epoch}")
            if isinstance(message, (Drain, Uncordon)):
                if isinstance(message, Uncordon) and self._stopping.is_set():
                    raise ValueError(f"instance {self.config.instance_id} is stopping: it admits nothing again")
                # Published at once, so that peers stop spilling here before the next tick.
                self.draining = isinstance(message, Drain)
                self._publish()
                return None
            if isinstance(message, ForwardSegment):
                return forward_segment(self.transport, self.ledger, self.pool, message,
                                       self.config.timeouts.peer_request_s, packer=self.lender.packer)
            return self._order_move(message)
        if isinstance(message, APBPassing):
            return self.apb_inbox.put(message, time.monotonic())
        if isinstance(message, APBChunkPrefill):
            if self.draining:
                raise ValueError(f"instance {self.config.instance_id} is draining: it takes no APB chunk")
            return self._serve_apb_chunk(message)
        if isinstance(message, AuditHeld):
            return self.lender.stale_held(self.engine, message)
        if isinstance(message, Echo):
            return EchoReply(message.payload)
        raise ValueError(f"instance {self.config.instance_id} does not serve {message.TYPE}")

    async def _order_move(self, message: MoveKV) -> None:
        """A gManager move of blocks of this instance's own request: from its home pool, or from
        a creditor to another creditor (the home drives it: only it may switch its table)."""
        own = self.config.instance_id
        if not self.config.share_kv:
            raise ValueError(f"instance {own} does not share KV (share_kv = false): it moves no blocks")
        if message.home_inst_id != own:
            raise ValueError(f"instance {own} moves only its own requests' blocks; "
                             f"asked to move blocks of a request of instance {message.home_inst_id}")
        if message.dst_inst_id == own:
            raise ValueError(f"instance {own} does not take blocks back home on command")
        if message.src_inst_id == message.dst_inst_id:
            raise ValueError(f"a move from instance {message.src_inst_id} to itself")
        for inst_id in {message.src_inst_id, message.dst_inst_id} - {own}:
            try:
                self.peers.by_inst(inst_id)
            except KeyError:
                raise ValueError(f"instance {inst_id} is not a known peer") from None
        if str(message.req_id) not in self.engine.scheduler.requests:
            raise ValueError(f"no request {message.req_id} here")
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._ordered_moves.append((message, done))
        self._work.set()
        if not await done:
            raise MoveNotDone(f"move of {message.num_blocks} blocks of request {message.req_id} "
                              f"to instance {message.dst_inst_id} did not commit")
        return None

    async def _carry_out_ordered_moves(self) -> None:
        """At a step boundary: switch the tables of moves whose data the peers committed, and
        start new ordered moves in the background (the engine steps while their messages travel)."""
        waiting, self._at_step_boundary = self._at_step_boundary, []
        for function, ran in waiting:
            # Run even for a waiter that gave up (the daemon stops): the peer committed the copy.
            try:
                result = function()
            except Exception as exc:  # the waiter's to handle
                if not ran.done():
                    ran.set_exception(exc)
                continue
            if not ran.done():
                ran.set_result(result)
        moves, self._ordered_moves = self._ordered_moves, []
        for message, done in moves:
            if message.epoch < self.fence.newest_epoch:
                # A newer leader spoke while this waited for the step boundary.
                self.fence.refuse_late()
                self.metrics.stale_epoch_commands.inc()
                self.metrics.moves.labels(result="stale_epoch").inc()
                if not done.done():
                    done.set_result(False)
                continue
            if message.src_inst_id == self.config.instance_id:
                task = asyncio.ensure_future(self._send_ordered_move(message, done))
                self._moves_in_flight.add(task)
                task.add_done_callback(self._moves_in_flight.discard)
                continue
            task = asyncio.ensure_future(self._relocate_ordered(message, done))
            self._moves_in_flight.add(task)
            task.add_done_callback(self._moves_in_flight.discard)

    async def _relocate_ordered(self, message: MoveKV, done: asyncio.Future[bool]) -> None:
        """A creditor-to-creditor move in the background, each segment's switch at a step
        boundary: the engine steps while the data travels (awaited in the engine loop, a few
        moves to a peer that does not answer took whole watchdog periods)."""
        try:
            dst = self.peers.by_inst(message.dst_inst_id)
            ok = await self.lender.move_held(self.engine, str(message.req_id), message.num_blocks,
                                             self.peers.by_inst(message.src_inst_id), dst, message.epoch,
                                             still_ordered=self._still_ordered(message),
                                             at_step_boundary=self._run_at_step_boundary)
        except Exception as exc:  # the gManager hears of it; the engine goes on
            log.warning("ordered move %d failed: %s", message.move_id, exc)
            ok = False
        if not done.done():
            done.set_result(ok)

    async def _run_at_step_boundary(self, function: Callable[[], object]) -> object:
        """``function()`` run by the engine loop at its next step boundary; its result or error."""
        ran: asyncio.Future = asyncio.get_running_loop().create_future()
        self._at_step_boundary.append((function, ran))
        self._work.set()  # an idle engine loop wakes to run it
        return await ran

    async def _send_ordered_move(self, message: MoveKV, done: asyncio.Future[bool]) -> None:
        """Reserve, send and commit in the background, piece by piece; each piece's switch waits
        for a step boundary. ``done``: True when any block moved (the gManager sees the rest in
        the next heartbeats)."""
        moved = 0
        try:
            dst = self.peers.by_inst(message.dst_inst_id)
            # The plan comes from a heartbeat up to a period old: a spill of the same request
            # may be under way. It ends within a piece's round trips; then this move goes on.
            await self.lender.until_not_moving(str(message.req_id), self.config.timeouts.peer_request_s)
            moved = await self.lender.move(self.engine, str(message.req_id), message.num_blocks, dst,
                                           switch=self._switch_at_step_boundary, epoch=message.epoch,
                                           still_ordered=self._still_ordered(message))
        except Exception as exc:  # the gManager hears of it; the engine goes on
            log.warning("ordered move %d failed: %s", message.move_id, exc)
        if 0 < moved < message.num_blocks:
            log.info("ordered move %d: %d of %d blocks moved", message.move_id, moved, message.num_blocks)
        if not done.done():
            done.set_result(moved > 0)

    def _still_ordered(self, message: MoveKV) -> Callable[[], bool]:
        """Whether the leader that ordered ``message`` is still the newest this instance knows:
        a move of several pieces stops once a newer one spoke (its plan may differ)."""
        def still_ordered() -> bool:
            if message.epoch >= self.fence.newest_epoch:
                return True
            self.fence.refuse_late()
            self.metrics.stale_epoch_commands.inc()
            return False
        return still_ordered

    async def _switch_at_step_boundary(self, move: SegmentMove, dst: Peer) -> bool:
        """Hand a committed piece to the engine loop, which switches it at the next step boundary."""
        return await self._run_at_step_boundary(lambda: self.lender.switch_move(self.engine, move, dst))

    def _try_move(self, message: TryMoveKV) -> MoveReserved | MoveRejected:
        self._note_home_run(message.home_inst_id, message.home_run)
        # A refusal's figure is what the requester may count on here: the home keeps it as this
        # instance's free blocks until the next membership tick.
        if message.epoch and not self.fence.admit(message.epoch):
            self.metrics.stale_epoch_commands.inc()
            return MoveRejected(message.move_id, MoveRejectReason.STALE_EPOCH, max(0, self._free_for_others()))
        if message.block_nbytes != self.block_nbytes:
            return MoveRejected(message.move_id, MoveRejectReason.LAYOUT_MISMATCH, 0)  # none of its blocks fit
        if self.draining:
            return MoveRejected(message.move_id, MoveRejectReason.DRAINING, 0)
        # What this pool keeps for the request (its home asked before it started) is its own.
        spare = self._free_for_others() + self.ledger.hold_of(message.home_inst_id, message.req_id)
        reservation = None
        if message.num_blocks <= spare:
            reservation = self.ledger.reserve(message.home_inst_id, message.req_id, message.num_blocks, time.monotonic())
        if reservation is None:
            return MoveRejected(message.move_id, MoveRejectReason.NO_SPACE, max(0, spare))
        return MoveReserved(message.move_id, reservation.reservation_id, reservation.block_ids,
                            int(self.config.timeouts.reservation_s * 1000))

    def _place(self, message: Message) -> list[torch.Tensor] | None:
        """KV block data goes straight into the reserved blocks of the pool."""
        if not isinstance(message, KVBlocks):
            return None
        reservation = self.ledger.reservations.get(message.reservation_id)
        if reservation is None:
            raise PlacementRefused(f"no reservation {message.reservation_id} (expired or never made)")
        if (message.home_inst_id, message.req_id) != (reservation.home_inst_id, reservation.req_id):
            raise PlacementRefused(
                f"reservation {reservation.reservation_id} is for request {reservation.req_id} of instance "
                f"{reservation.home_inst_id}, not request {message.req_id} of instance {message.home_inst_id}")
        if reservation.receiving:
            raise PlacementRefused(f"data for reservation {reservation.reservation_id} is landing already")
        if reservation.filled:  # sent again: taking it would put the reservation's expiry off
            raise PlacementRefused(f"the data of reservation {reservation.reservation_id} has landed already")
        # The runs fill every reserved block once: a commit with the data, or one after it, must
        # not make a segment of blocks nobody wrote.
        reserved = set(reservation.block_ids)
        written: set[int] = set()
        views = []
        for run in message.runs:
            ids = range(run.dst_block_id, run.dst_block_id + run.num_blocks)
            if not reserved.issuperset(ids) or not written.isdisjoint(ids):
                raise PlacementRefused(f"blocks {ids.start}..{ids.stop - 1} are not in reservation "
                                       f"{reservation.reservation_id}, or are written twice")
            written.update(ids)
            views.append(self.pool[ids.start:ids.stop])
        if written != reserved:
            raise PlacementRefused(f"the runs fill {len(written)} of the {len(reserved)} blocks of reservation "
                                   f"{reservation.reservation_id}")
        # UCX writes into these blocks until the frame's receive ends (bounded by the transport's
        # frame timeout): the reservation outlives that, or its blocks could be given to others
        # while still being written.
        self.ledger.hold_while_receiving(message.reservation_id, time.monotonic() + self._frame_timeout_s)
        return views

    # ---- upkeep ---------------------------------------------------------------------------
    async def _maintenance_loop(self) -> None:
        interval = self.config.timeouts.heartbeat_interval_s
        watchdog = self.notifier.watchdog_interval_s
        period = min(interval, watchdog) if watchdog else interval
        while True:
            try:
                self._tick()
            except Exception:  # one bad tick must not stop the upkeep
                log.exception("maintenance tick failed")
            if watchdog:
                self._ping_watchdog(2 * watchdog)
            await asyncio.sleep(period)

    def _ping_watchdog(self, watchdog_s: float) -> None:
        """WATCHDOG=1, unless the engine loop has been inside one turn for ``watchdog_s`` (systemd's
        WatchdogSec): a step stuck on a hung device leaves the event loop turning, and only the
        missing pings get the daemon restarted."""
        stuck_s = time.monotonic() - self._engine_turned_at
        if self._engine_idle or stuck_s < watchdog_s:
            self.notifier.watchdog()
            self._watchdog_withheld = False
        elif not self._watchdog_withheld:
            self._watchdog_withheld = True
            log.error("the engine loop has not turned for %.0f s: no more watchdog pings (systemd restarts "
                      "this instance after WatchdogSec)", stuck_s)

    def _tick(self) -> None:
        now = time.monotonic()
        for home, step_id in (self.step_server.check_deadlines() if self.step_server is not None else ()):
            log.warning("instance %d's step %d did not end here within %.1f s: its mailbox was freed", home,
                        step_id, self.config.timeouts.peer_request_s)
        self.ledger.release_expired(now)
        self._publish()
        members = self.membership.members()
        for inst_id in self.peers.retain_members(set(members)):
            log.info("instance %d left the membership: it takes no blocks from here", inst_id)
        for member in members.values():
            if member.inst_id != self.config.instance_id:
                peer = self.peers.update(member.inst_id, PeerAddress(member.peer_host, member.peer_port),
                                         member.num_blocks_free, member.draining, member.num_blocks_total)
                self._connect_ahead(peer)
        self._forget_restarted_homes(members)
        # A home that keeps publishing is alive even while its requests wait and send nothing.
        for home in list(self.ledger.last_heard):
            if home in members:
                self.ledger.heard_from(home, now)
        for home, freed in self.ledger.free_lost_debtors(now, self.config.timeouts.debtor_lost_s).items():
            log.warning("instance %d went silent: freed %d blocks held for it", home, freed)
            self.creditor.forget(home)
            self._forget_steps_of(home)
        self._audit_held(now)
        self.lender.renew_holds(now)
        self._update_metrics(now)
        self._send_heartbeat()

    def _audit_held(self, now: float) -> None:
        """Ask each home whose segments are held here, every ``held_audit_s``, which of them it
        still counts on, and free the others: a FreeSegment whose every retry failed would
        otherwise hold them for as long as the home lives (it publishes, so it never looks lost)."""
        period = self.config.timeouts.held_audit_s
        homes = {key[0] for key in self.ledger.held}
        for home in list(self._audited_at):
            if home not in homes:
                del self._audited_at[home]
                self._audit_next.pop(home, None)
        for home in homes:
            since = self._audited_at.setdefault(home, now)  # first seen holding: one period from now
            if home in self._audits or now - since < period:
                continue
            try:
                address = self.peers.by_inst(home).address
            except KeyError:  # not in the membership: free_lost_debtors deals with it
                continue
            self._audited_at[home] = now
            task = asyncio.get_running_loop().create_task(self._audit_home(home, address))
            self._audits[home] = task
            task.add_done_callback(lambda _, home=home: self._audits.pop(home, None))

    async def _audit_home(self, home: int, address: PeerAddress) -> None:
        try:
            freed, after = await audit_held(
                self.transport, self.ledger, self.config.instance_id, home, address,
                self.config.timeouts.peer_request_s, after=self._audit_next.get(home))
        except (TransportError, RuntimeError) as exc:  # the next period asks again
            log.info("audit of the segments held for instance %d: %s", home, exc)
            self.metrics.held_audits.labels(result="failed").inc()
            return
        self.metrics.held_audits.labels(result="answered").inc()
        if after is None or home not in self._audited_at:  # every segment had its turn, or none is left
            self._audit_next.pop(home, None)
        else:
            self._audit_next[home] = after
        if freed:
            log.warning("instance %d no longer counts on %d blocks held here for it (its free has not arrived): "
                        "freed", home, freed)
            self.metrics.held_blocks_reclaimed.inc(freed)
            if not self.ledger.has_segments_of(home):
                self.creditor.forget(home)

    def _note_home_run(self, home_inst_id: int, run_id: int) -> None:
        """A home's request names its run: where this instance holds blocks for another run of
        it, that home restarted, perhaps since this instance last read the membership. The old
        run's blocks are freed before the new run's request is served, so that the membership
        tick that sees the restart later frees nothing of the new run's."""
        freed = self.ledger.note_home_run(home_inst_id, run_id)
        if freed is not None:
            self.creditor.forget(home_inst_id)
            self._forget_steps_of(home_inst_id)
            log.warning("instance %d restarted (its run is new): freed %d blocks held for its previous run",
                        home_inst_id, freed)

    def _forget_restarted_homes(self, members: dict[int, Member]) -> None:
        """Free what this instance holds for a home whose process is another than before: a home
        restarted within ``debtor_lost_s`` keeps publishing under its instance id, so it never
        looks silent, and its new run knows nothing of the old one's segments (and numbers its
        requests from 1 again)."""
        for inst_id, member in members.items():
            run = (member.peer_host, member.pid, member.run_id)
            before = self._member_runs.get(inst_id)
            self._member_runs[inst_id] = run
            if before is not None and before != run:
                self.peers.end_quarantine(inst_id)
            if before is None or before == run or inst_id not in self.ledger.last_heard:
                continue
            if member.run_id and self.ledger.home_runs.get(inst_id) == member.run_id:
                continue  # what is held here is the new run's: the old run's went at its first request
            freed = self.ledger.forget_home(inst_id)
            self.creditor.forget(inst_id)
            self._forget_steps_of(inst_id)
            log.warning("instance %d restarted (pid %d, before %d): freed %d blocks held for its previous run",
                        inst_id, member.pid, before[1], freed)

    def _connect_ahead(self, peer: Peer) -> None:
        """Open the connection to a peer before any step needs it: the handshake waits for the
        peer's event loop, which a step of its own can hold for longer than a connect may take."""
        if not self.config.share_kv or peer.inst_id in self._connecting:
            return
        task = asyncio.get_running_loop().create_task(self._connect_quietly(peer))
        self._connecting[peer.inst_id] = task
        task.add_done_callback(lambda _: self._connecting.pop(peer.inst_id, None))

    async def _connect_quietly(self, peer: Peer) -> None:
        try:
            await self.transport.connect(peer.address)
        except TransportError as exc:  # the next tick tries again; a request would say the same
            log.debug("connection ahead to instance %d failed: %s", peer.inst_id, exc)

    # ---- the gManager ---------------------------------------------------------------------
    def _find_leader(self) -> tuple[int, PeerAddress] | None:
        """The gManager leader: the etcd leader key (epoch: its create revision), or the record
        in the state folder (local election) if its process is alive."""
        if self.config.discovery == "etcd":
            info = self.membership.leader()  # the watched copy: no I/O here
            return None if info is None else (info.epoch, PeerAddress(info.peer_host, info.peer_port))
        path = Path(self.config.state_dir) / "gmanager" / "leader.json"
        try:
            leader = json.loads(path.read_text())
            pid, epoch = int(leader["pid"]), int(leader["epoch"])
            address = PeerAddress(str(leader["peer_host"]), int(leader["peer_port"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return (epoch, address) if process_alive(pid) else None

    def _send_heartbeat(self) -> None:
        if self._heartbeat_task is not None and not self._heartbeat_task.done():
            return  # the last one is still on its way: never more than one in flight
        leader = self._find_leader()
        if leader is None:
            self._leader = None
            return
        if self._leader is None or self._leader[0] != leader[0]:
            self.heartbeats.leader_changed()
        self._leader = leader
        heartbeat = self.heartbeats.next(self._pool_figures(), len(self.engine.scheduler.running),
                                         self._placement_entries(), remote_waits=self.metrics.remote_wait_totals.take(),
                                         attend_serves=self.metrics.attend_serve_totals.take())
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._exchange_heartbeat(leader[1], heartbeat))

    async def _exchange_heartbeat(self, leader: PeerAddress, heartbeat: Heartbeat) -> None:
        try:
            reply = await self.transport.request(leader, heartbeat, timeout_s=self.config.timeouts.peer_request_s)
        except Exception as exc:  # noqa: BLE001  the leader may be changing: try again next period
            log.info("heartbeat to the gManager at %s: %s", leader, exc)
            return
        if not isinstance(reply, HeartbeatReply):
            log.warning("the gManager answered a heartbeat with %s", type(reply).__name__)
            return
        if not self.fence.admit(reply.epoch):
            self.metrics.stale_epoch_commands.inc()
            return
        self.heartbeats.on_reply(reply)
        for hint in reply.creditors:
            if hint.inst_id != self.config.instance_id:
                try:
                    self.peers.by_inst(hint.inst_id).num_blocks_free = hint.num_blocks_free
                except KeyError:
                    pass  # not yet in the membership: its address comes with it

    def _num_blocks_borrowed(self) -> int:
        """Blocks of this instance's requests held on peers."""
        bm = self.engine.block_manager
        return sum(len(s.block_ids) for r in self.engine.scheduler.requests for s in bm.block_table(r)
                   if not bm.is_local(s.instance_id))

    def _pool_figures(self) -> PoolFigures:
        bm, home = self.engine.block_manager, self.engine.home_instance_id
        return PoolFigures(bm.num_total_blocks(home), bm.num_free_blocks(home),
                           self.ledger.num_blocks_held + self.ledger.num_blocks_reserved, self._num_blocks_borrowed())

    def _placement_entries(self) -> list[RequestPlacementEntry]:
        """Blocks of every request of this home, per instance holding them; the home's blocks
        are movable once some are written and no move of the request is under way."""
        bm = self.engine.block_manager
        entries = []
        for request_id in self.engine.scheduler.requests:
            blocks: dict[int, int] = {}
            for segment in bm.block_table(request_id):
                blocks[segment.instance_id] = blocks.get(segment.instance_id, 0) + len(segment.block_ids)
            entries.extend(RequestPlacementEntry(int(request_id), self.peers.cluster_id(i), n, bm.is_local(i),
                                                 not bm.is_local(i) or self.lender.lendable_now(self.engine, request_id) > 0)
                           for i, n in blocks.items())
        return entries

    def _free_for_others(self) -> int:
        """Free blocks beyond what this instance's own next step may need."""
        if not self.config.share_kv:
            return 0
        free = self.engine.block_manager.num_free_blocks(self.engine.home_instance_id)
        # Less what this home's own running prompts count on, and what other homes' starting
        # requests were promised here.
        return max(0, free - self.engine.home_blocks_wanted() - self.engine.home_blocks_promised()
                   - self.ledger.num_blocks_on_hold)

    def _publish(self) -> None:
        if self._withdrawn:
            return
        bm = self.engine.block_manager
        self.membership.publish(Member(
            inst_id=self.config.instance_id, pid=os.getpid(), peer_host=self.transport.address.host,
            peer_port=self.transport.address.port, http_port=self.http_port, socket_path=str(self.config.socket_path),
            num_blocks_total=bm.num_total_blocks(self.engine.home_instance_id),
            num_blocks_free=0 if self.draining else self._free_for_others(), draining=self.draining,
            updated_at=time.time(), run_id=self.run_id))

    def _update_metrics(self, now: float) -> None:
        bm, m = self.engine.block_manager, self.metrics
        total = bm.num_total_blocks(self.engine.home_instance_id)
        m.requests_running.set(len(self.engine.scheduler.running))
        m.requests_waiting.set(len(self.engine.scheduler.waiting))
        m.kv_blocks_total.set(total)
        m.kv_usage_ratio.set(1 - bm.num_free_blocks(self.engine.home_instance_id) / total)
        m.kv_blocks_lent.set(self.ledger.num_blocks_held + self.ledger.num_blocks_reserved)
        m.kv_blocks_borrowed.set(self._num_blocks_borrowed())
        self._tokens_window = [(t, n) for t, n in self._tokens_window if now - t <= 10.0]
        span = now - self._tokens_window[0][0] if len(self._tokens_window) > 1 else 0.0
        m.tokens_per_second.set(sum(n for _, n in self._tokens_window[1:]) / span if span > 0 else 0.0)

    # ---- the local API's reads and commands ----------------------------------------------------
    def _forget_steps_of(self, home_inst_id: int) -> None:
        """The home is gone or restarted: its step mailboxes here are given up."""
        if self.step_server is not None:
            self.step_server.forget(home_inst_id)

    def _step_protocol_status(self) -> dict[str, Any]:
        """The step protocol's figures: as a home (steps whose creditors' parts went through a
        mailbox, and those that failed there) and as a creditor (mailboxes open here, steps
        queued, steps given up by the watchdog)."""
        remote = self.remote if isinstance(self.remote, MailboxRemoteAttention) else None
        server = self.step_server
        graphs = self.engine.split_decode_graphs if self.engine is not None else None
        return {
            "mode": "mailboxes" if remote is not None else "messages",
            "home_steps_on_mailboxes": remote.steps_on_mailboxes if remote else 0,
            "home_steps_failed": remote.steps_failed if remote else 0,
            "home_mailboxes": remote.mailbox_peers if remote else [],
            # Steps whose queries waited for their StepBegin's answer (their slices changed),
            # and creditors told to let a step queued ahead go.
            "home_steps_answer_first": remote.steps_answer_first if remote else 0,
            "home_stand_downs": remote.stand_downs if remote else 0,
            # Creditors reached by an NCCL link (other hosts), and steps that went over one.
            "home_links_made": remote.links_made if remote else 0,
            "home_steps_on_links": remote.steps_on_links if remote else 0,
            "creditor_links_made": server.links_made if server else 0,
            # Split decode steps run as one graph, remote parts included, and graphs captured.
            "home_step_graph_replays": graphs.replays if graphs else 0,
            "home_step_graph_captures": graphs.captures if graphs else 0,
            # Split decode steps that went layer by layer instead (a creditor without a device
            # mailbox, a shape no graph takes).
            "home_split_steps_by_layer": self.engine.split_decode_steps_by_layer if self.engine is not None else 0,
            "creditor_mailboxes": server.num_mailboxes if server else 0,
            "creditor_steps_begun": server.steps_begun if server else 0,
            "creditor_graph_replays": server.graph_replays if server else 0,
            # False once a capture failed here: the creditor's steps then go eagerly.
            "creditor_graphs_on": server.cuda_graphs if server else False,
            "creditor_steps_timed_out": server.timeouts if server else 0,
            # Steps found queued ahead when their StepBegin came, and steps queued ahead let go.
            "creditor_steps_assigned_ahead": server.steps_assigned_ahead if server else 0,
            "creditor_steps_let_go": server.steps_let_go if server else 0,
        }

    def status(self) -> dict[str, Any]:
        engine, bm = self.engine, self.engine.block_manager
        home = engine.home_instance_id
        requests = []
        for request_id, request in engine.scheduler.requests.items():
            requests.append({
                "request_id": request_id,
                "state": request.status.name.lower(),
                "num_tokens": request.num_tokens,
                "segments": [{"instance_id": self.peers.cluster_id(s.instance_id), "token_start": s.token_start,
                              "num_tokens": s.num_tokens, "block_ids": list(s.block_ids)} for s in bm.block_table(request_id)],
            })
        return {
            "instance_id": self.config.instance_id,
            "model": self.served_model,
            "peer_address": str(self.transport.address),
            "draining": self.draining,
            "epoch": self.fence.newest_epoch,
            "stale_epoch_commands": self.fence.num_refused,
            "pool": {
                "num_blocks_total": bm.num_total_blocks(home),
                "num_blocks_free": bm.num_free_blocks(home),
                "num_blocks_held_for_others": self.ledger.num_blocks_held,
                "num_blocks_reserved_for_others": self.ledger.num_blocks_reserved,
                "num_blocks_kept_for_others": self.ledger.num_blocks_on_hold,
                "block_size": engine.config.block_size,
            },
            "requests": requests,
            "peer_shared_memory": self.transport.shared_memory_status(),
            "step_protocol": self._step_protocol_status(),
            "holds": [{"home_instance_id": home, "request_id": req, "num_blocks": hold.num_blocks}
                      for (home, req), hold in self.ledger.holds.items()],
            "held_segments": [{"home_instance_id": s.home_inst_id, "request_id": s.req_id, "segment_id": s.segment_id,
                               "num_blocks": len(s.block_ids)} for s in self.ledger.held.values()],
        }

    async def uncordon(self) -> dict[str, Any]:
        """Admit requests again after a drain (not once stopping)."""
        if self._stopping.is_set():
            raise RequestRefused(f"instance {self.config.instance_id} is stopping: it admits nothing again", status=409)
        self.draining = False
        self._publish()
        return {"draining": False}

    async def drain(self) -> dict[str, Any]:
        """Stop admitting. Safe to stop once nothing runs here and nothing is held for others."""
        self.draining = True
        self._publish()
        running = len(self.engine.scheduler.requests)
        held = self.ledger.num_blocks_held + self.ledger.num_blocks_reserved
        return {"draining": True, "running_requests": running, "blocks_held_for_others": held,
                "safe_to_stop": running == 0 and held == 0}
