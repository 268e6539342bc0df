"""The home's side of the step protocol: a creditor of this host attended through a mailbox.

For each step, the first layer's call for a creditor with an open mailbox sends one
``StepBegin`` (the step's slices) and, from then on, each layer's part is queued, not awaited:

- on a GPU, on the step's stream: the query's copy into the creditor's mailbox and its flag,
  then (where the step awaits the part, after its own attention) a stream wait for the result
  flag. The parts are views of the mailbox's result slots, merged in place. No event-loop turn
  and no host wait between layers: the step is as a local one, its kernels queued ahead.
- on the host: the query written and flagged, then the result flag polled.

The step's reply (``Ack``) and the mailbox's status are read once, at the step's end
(``finish_step``): a step the creditor refused, or gave up on, fails there as any lost part
does (``PeerPartFailed``), and its mailbox is dropped. A step whose device work does not end by
its deadline is released by ``release_step`` (the engine's watchdog): the result flags are set
``ABORTED`` from a stream of their own, the device finishes, and the step fails.

Each ``StepBegin`` asks the creditor to queue the next step of the same slices behind this one
(``ahead``): a home whose step is as its last one's sends its ``StepBegin`` and runs at once, its
creditor's layers already queued; one whose step differs (other rows, other segments) first
awaits the ``StepBegin``'s answer, which the creditor gives once the step queued ahead is let
go and this one is queued. A creditor this home's step no longer attends over, and every one
once this home goes idle, is told to stand down (``StepStandDown``).

A creditor on another host gets a *link* instead of a shared mailbox (``nccl_links``): the home
asks for one once a creditor refused a shared mailbox as on another host (or at once, with
``nccl_links="always"``), and both ends make a two-rank NCCL communicator
(``transport/nccl_link.py``). The mailbox's slots are then each side's own memory and its
flags are NCCL's sends and receives, queued and captured as the flags were: the step is still
one graph, and no step is queued ahead (a send waits on the device for its receive instead).

A creditor with no mailbox yet is attended by messages while one is opened in the background;
one that cannot share a mailbox (another host, turned off) is asked again only after
``REOPEN_AFTER_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from infinite_llm.engine.dist_attention import AttendBatch, DevicePart, RemoteAttention
from infinite_llm.kernels import AttentionState
from infinite_llm.transport.errors import TransportError
from infinite_llm.transport.interface import Transport
from infinite_llm.transport.nccl_link import NcclError, NcclLink, NcclUnavailable, new_unique_id
from infinite_llm.transport.messages import (
    Ack,
    ErrorReply,
    StepBegin,
    StepMailboxClose,
    StepMailboxOpen,
    StepMailboxOpened,
    StepStandDown,
)
from infinite_llm.transport.step_mailbox import (
    FLAG_ABORTED,
    FLAG_EMPTY,
    FLAG_READY,
    OTHER_HOST,
    STATUS_OK,
    Mailbox,
    MailboxUnavailable,
    flag_address,
    layout_of,
    make_local_mailbox,
    open_mailbox,
    stream_flags,
)
from infinite_llm.transport.tensors import TORCH_DTYPE_NAMES

from .config import NCCL_LINK_MODES
from .peers import Peer, PeerDirectory, PeerPartFailed, TransportRemoteAttention

log = logging.getLogger(__name__)

# A creditor that could not open a mailbox is asked again after this long, s.
REOPEN_AFTER_S = 30.0
# A host home's poll of a result flag: turns of the event loop first, then sleeps of this long, s.
HOST_SPIN_S = 0.002
HOST_POLL_S = 0.0002


@dataclass
class _Opened:
    mailbox_id: int
    mailbox: Mailbox
    inst_id: int
    # (slices, rows) of the step the creditor keeps queued ahead for this home, None for none.
    ahead_key: tuple | None = None
    standing_down: asyncio.Future | None = None  # the last StepStandDown's answer
    link: NcclLink | None = None  # a creditor of another host: the layers go by NCCL


def _receive_result(link: NcclLink, mailbox: Mailbox, layer: int, rows: int) -> None:
    """Queue the receives of a layer's part over ``link`` into ``mailbox``'s result slots."""
    with link.group():
        link.recv(mailbox.out[layer, :rows])
        link.recv(mailbox.lse[layer, :rows])


class _MailboxPart(DevicePart):
    """A creditor's device mailbox as a step graph's part: flags set and awaited by stream
    memory operations, which a graph captures."""

    def __init__(self, opened: _Opened) -> None:
        mailbox = opened.mailbox
        self.key = (opened.inst_id, opened.mailbox_id)
        self.q, self.out, self.lse = mailbox.q, mailbox.out, mailbox.lse
        self._q_flags, self._result_flags = mailbox.q_flags, mailbox.result_flags
        self._flags = stream_flags()

    def announce_query(self, layer: int, rows: int) -> None:
        self._flags.write(flag_address(self._q_flags, layer), FLAG_READY)

    def await_result(self, layer: int, rows: int) -> None:
        result_flag = flag_address(self._result_flags, layer)
        self._flags.wait(result_flag, FLAG_READY)
        self._flags.write(result_flag, FLAG_EMPTY)


class _LinkPart(DevicePart):
    """A creditor of another host as a step graph's part: the slots are this home's own memory,
    the query sent and the result received over the NCCL link, which a graph captures."""

    def __init__(self, opened: _Opened) -> None:
        self._mailbox = mailbox = opened.mailbox
        self.key = (opened.inst_id, opened.mailbox_id)
        self.q, self.out, self.lse = mailbox.q, mailbox.out, mailbox.lse
        self._link = opened.link

    def announce_query(self, layer: int, rows: int) -> None:
        self._link.send(self.q[layer, :rows])

    def await_result(self, layer: int, rows: int) -> None:
        _receive_result(self._link, self._mailbox, layer, rows)


@dataclass
class _StepOnMailbox:
    """One creditor's part of one step, through its mailbox."""

    opened: _Opened
    peer: Peer
    reply: Awaitable  # the StepBegin's answer
    num_rows: int
    deadline: float  # time.monotonic()
    released: bool = False
    # Queries wait for the StepBegin's answer: the creditor may have queued a step of other
    # slices ahead, which would take them.
    answer_first: bool = False


class MailboxRemoteAttention(RemoteAttention):
    """Remote parts through creditors' mailboxes where they have one, else by ``messages``."""

    def __init__(self, messages: TransportRemoteAttention, transport: Transport, peers: PeerDirectory, *,
                 num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_rows: int, timeout_s: float, host_id: str, clock: Callable[[], float] = time.monotonic,
                 steps_ahead: int = 1, nccl_links: str = "auto") -> None:
        if nccl_links not in NCCL_LINK_MODES:
            raise ValueError(f"nccl_links is one of {', '.join(NCCL_LINK_MODES)}, not {nccl_links!r}")
        self.messages = messages
        self.transport = transport
        self.peers = peers
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_rows = max_rows
        self.timeout_s = timeout_s
        self.host_id = host_id
        self.clock = clock
        self._opened: dict[int, _Opened] = {}  # creditor inst id -> its mailbox for this home
        self._opening: dict[int, asyncio.Task] = {}
        self._refused_until: dict[int, float] = {}
        self._steps: dict[tuple[int, int], _StepOnMailbox] = {}  # (step id, engine id) -> the part
        self._parts: dict[tuple[int, int], _MailboxPart] = {}  # (inst id, mailbox id) -> its graph part
        self._side_stream: torch.cuda.Stream | None = None
        self._tasks: set[asyncio.Task] = set()
        self.steps_ahead = steps_ahead
        self.nccl_links = nccl_links if device.type == "cuda" else "never"
        self.links_made = 0
        self.steps_on_links = 0
        self.steps_on_mailboxes = 0
        self.steps_failed = 0
        self.steps_answer_first = 0  # steps whose queries waited for their StepBegin's answer
        self.stand_downs = 0

    # Where the engine's watchdog looks for how long a step's device work may take.
    @property
    def step_timeout_s(self) -> float:
        return self.timeout_s

    @property
    def device_part_rows(self) -> int | None:
        # Only a link's StepBegin carries its graph's rows (a mailbox's flags need none).
        return self.max_rows if any(o.link is not None for o in self._opened.values()) else None

    def has_mailbox(self, inst_id: int) -> bool:
        return inst_id in self._opened

    @property
    def mailbox_peers(self) -> list[int]:
        """The creditors this home has a mailbox at, by instance id."""
        return sorted(self._opened)

    # ---- opening ---------------------------------------------------------------------------
    def _ensure_opening(self, peer: Peer) -> None:
        if peer.inst_id in self._opening or self.clock() < self._refused_until.get(peer.inst_id, 0.0):
            return
        self._opening[peer.inst_id] = asyncio.ensure_future(self._open(peer))

    async def _open(self, peer: Peer) -> None:
        try:
            if self.nccl_links == "always":
                opened = await self._open_link(peer)
            else:
                try:
                    opened = await self._open_shared(peer)
                except MailboxUnavailable as e:
                    if self.nccl_links != "auto" or not str(e).startswith(OTHER_HOST):
                        raise
                    opened = await self._open_link(peer)
            self._opened[peer.inst_id] = opened
            log.info("instance %d: step %s %d open, its layers go through it", peer.inst_id,
                     "link" if opened.link is not None else "mailbox", opened.mailbox_id)
        except (MailboxUnavailable, NcclUnavailable, NcclError, TransportError, ValueError, TimeoutError) as e:
            log.info("instance %d: no step mailbox (%s); attending by messages", peer.inst_id, e)
            self._refused_until[peer.inst_id] = self.clock() + REOPEN_AFTER_S
        finally:
            self._opening.pop(peer.inst_id, None)

    def _layout(self):
        return layout_of(self.num_layers, self.max_rows, self.num_heads, self.head_dim, TORCH_DTYPE_NAMES[self.dtype])

    def _open_request(self, peer: Peer, nccl_id: str = "") -> StepMailboxOpen:
        return StepMailboxOpen(self.peers.own_inst_id, peer.inst_id, self.num_layers, self.max_rows,
                               self.num_heads, self.head_dim, TORCH_DTYPE_NAMES[self.dtype], self.host_id,
                               nccl_id=nccl_id)

    async def _open_shared(self, peer: Peer) -> _Opened:
        reply = await self.transport.request(peer.address, self._open_request(peer), timeout_s=self.timeout_s)
        if not isinstance(reply, StepMailboxOpened) or reply.nccl:
            raise MailboxUnavailable(reply.detail if isinstance(reply, ErrorReply) else
                                     f"answered {type(reply).__name__}")
        mailbox = open_mailbox(self._layout(), reply.nbytes, self.device, reply.device[0] if reply.device else None,
                               reply.host_path)
        return _Opened(reply.mailbox_id, mailbox, peer.inst_id)

    async def _open_link(self, peer: Peer) -> _Opened:
        """A two-rank NCCL link with the creditor (this home rank 0), both ends made at once:
        each blocks until the other joined, here on a thread."""
        layout = self._layout()
        unique_id = new_unique_id()
        reply = await self.transport.request(peer.address, self._open_request(peer, unique_id.hex()),
                                             timeout_s=self.timeout_s)
        if not isinstance(reply, StepMailboxOpened) or not reply.nccl:
            raise MailboxUnavailable(reply.detail if isinstance(reply, ErrorReply) else
                                     f"answered {type(reply).__name__} without a link")
        if reply.nbytes != layout.nbytes:
            raise MailboxUnavailable(f"a link's mailbox of {reply.nbytes} bytes for a layout of {layout.nbytes}")
        mailbox = make_local_mailbox(layout, self.device)
        making = asyncio.ensure_future(asyncio.to_thread(NcclLink, unique_id, 0, self.device))
        try:
            # A creditor that died meanwhile leaves the thread waiting: it is left behind.
            link = await asyncio.wait_for(asyncio.shield(making), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            making.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().abort())
            self._background(self.transport.send(peer.address,
                                                 StepMailboxClose(self.peers.own_inst_id, reply.mailbox_id)))
            raise TimeoutError(f"the NCCL link was not made within {self.timeout_s} s") from None
        self.links_made += 1
        return _Opened(reply.mailbox_id, mailbox, peer.inst_id, link=link)

    def _drop(self, inst_id: int, why: str) -> None:
        opened = self._opened.pop(inst_id, None)
        if opened is None:
            return
        self._parts.pop((inst_id, opened.mailbox_id), None)
        if opened.link is not None:
            opened.link.abort_soon()
        log.warning("instance %d: step mailbox %d dropped: %s", inst_id, opened.mailbox_id, why)
        try:
            peer = self.peers.by_inst(inst_id)
        except KeyError:
            return
        self._background(self.transport.send(peer.address, StepMailboxClose(self.peers.own_inst_id, opened.mailbox_id)))

    def _background(self, coroutine) -> None:
        """Run ``coroutine`` as a task whose failure is logged, not raised (a close that cannot
        reach a creditor: the creditor's watchdog or its view of this home's death frees it)."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.info("closing a step mailbox: %s", t.exception())
        task.add_done_callback(done)

    # ---- a step ----------------------------------------------------------------------------
    def _begin(self, batch: AttendBatch, wire_rows: int = 0) -> _StepOnMailbox | None:
        peer = self.peers.by_engine(batch.instance_id)
        opened = self._opened.get(peer.inst_id)
        if opened is None:
            self._ensure_opening(peer)
            return None
        if batch.num_rows_host > self.max_rows:
            return None
        slices = self.messages._slices_of(batch)
        key = (slices, batch.num_rows_host)
        standing_down = opened.standing_down is not None and not opened.standing_down.done()
        answer_first = (opened.ahead_key is not None and opened.ahead_key != key) or standing_down
        # A link's sends wait on the device for their receives: nothing is queued ahead there.
        ahead = self.steps_ahead if opened.link is None else 0
        message = StepBegin(self.peers.own_inst_id, peer.inst_id, opened.mailbox_id, batch.step_id,
                            self.num_layers, slices, batch.num_rows_host, ahead=ahead,
                            wire_rows=0 if opened.link is None else max(wire_rows, batch.num_rows_host))
        reply = self.transport.request_soon(peer.address, message, timeout_s=self.timeout_s)
        opened.ahead_key = key if ahead else None
        step = _StepOnMailbox(opened, peer, asyncio.ensure_future(reply), batch.num_rows_host,
                              self.clock() + self.timeout_s, answer_first=answer_first)
        self.steps_answer_first += answer_first
        self._steps[(batch.step_id, batch.instance_id)] = step
        if opened.link is None:
            self.steps_on_mailboxes += 1
        else:
            self.steps_on_links += 1
        return step

    def begin_device_step(self, batches, wire_rows=None) -> list[DevicePart] | None:
        """Every batch's creditor with a device mailbox open: a StepBegin to each, and their
        parts for the step's graph. Else None, nothing sent (and mailboxes opened where
        missing, for the steps to come)."""
        opened = []
        for batch in batches:
            peer = self.peers.by_engine(batch.instance_id)
            mailbox = self._opened.get(peer.inst_id)
            if mailbox is None:
                self._ensure_opening(peer)
            opened.append(mailbox)
        if any(o is None or not o.mailbox.is_cuda for o in opened) or \
                any(batch.num_rows_host > self.max_rows for batch in batches):
            return None
        if wire_rows is None:
            wire_rows = [batch.num_rows_host for batch in batches]
        parts = []
        for batch, o, rows in zip(batches, opened, wire_rows):
            if self._begin(batch, rows) is None:  # not reached: checked above
                raise RuntimeError(f"step {batch.step_id}: mailbox {o.mailbox_id} could not begin")
            key = (o.inst_id, o.mailbox_id)
            part = self._parts.get(key)
            if part is None:
                part = self._parts[key] = _MailboxPart(o) if o.link is None else _LinkPart(o)
            parts.append(part)
        return parts

    async def device_step_ready(self, step_id: int) -> None:
        """Before the step's graph writes a query: the answers of the StepBegins that must come
        first (``answer_first``). Raises PeerPartFailed for one that is not ``Ack``."""
        for (sid, _), step in list(self._steps.items()):
            if sid == step_id and step.answer_first:
                await self._answered(step)

    async def _answered(self, step: _StepOnMailbox) -> None:
        await asyncio.wait([step.reply])  # its failure is read below, not raised here
        if _refused(step.reply):
            raise PeerPartFailed(step.peer.inst_id, step.peer.engine_id,
                                 RuntimeError(f"the creditor refused the step: {_reply_problem(step.reply)}"))
        step.answer_first = False

    def live_device_parts(self) -> set:
        return {(o.inst_id, o.mailbox_id) for o in self._opened.values()}

    def start(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> Awaitable[AttentionState]:
        key = (batch.step_id, batch.instance_id)
        step = self._steps.get(key)
        if step is None and layer == 0:
            step = self._begin(batch)
        if step is None:
            return self.messages.start(batch, layer, q, sm_scale)
        if step.answer_first:
            return self._answered_then_collect(step, layer, q)
        self._put_query(step, layer, q)
        return self._collect(step, layer)

    def _put_query(self, step: _StepOnMailbox, layer: int, q: torch.Tensor) -> None:
        mailbox, n = step.opened.mailbox, step.num_rows
        mailbox.q[layer, :n].copy_(q)
        if step.opened.link is not None:
            step.opened.link.send(mailbox.q[layer, :n])
        elif mailbox.is_cuda:
            stream_flags().write(flag_address(mailbox.q_flags, layer), FLAG_READY)
        else:
            mailbox.q_flags[layer] = FLAG_READY

    async def _answered_then_collect(self, step: _StepOnMailbox, layer: int, q: torch.Tensor) -> AttentionState:
        await self._answered(step)
        self._put_query(step, layer, q)
        return await self._collect(step, layer)

    async def attend(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> AttentionState:
        return await self.start(batch, layer, q, sm_scale)

    async def _collect(self, step: _StepOnMailbox, layer: int) -> AttentionState:
        """The layer's part: on a GPU queued behind a stream wait (returns at once); on the host
        once its flag is set."""
        mailbox, n = step.opened.mailbox, step.num_rows
        if step.opened.link is not None:
            _receive_result(step.opened.link, mailbox, layer, n)
        elif mailbox.is_cuda:
            flags = stream_flags()
            result_flag = flag_address(mailbox.result_flags, layer)
            flags.wait(result_flag, FLAG_READY)
            flags.write(result_flag, FLAG_EMPTY)
        else:
            spin_until = time.monotonic() + HOST_SPIN_S
            while int(mailbox.result_flags[layer]) < FLAG_READY:
                if _refused(step.reply):
                    step.released = True
                    raise PeerPartFailed(step.peer.inst_id, step.peer.engine_id,
                                         RuntimeError(f"the creditor refused the step: {_reply_problem(step.reply)}"))
                if self.clock() >= step.deadline:
                    step.released = True
                    raise PeerPartFailed(step.peer.inst_id, step.peer.engine_id,
                                         TimeoutError(f"layer {layer} not answered within {self.timeout_s} s"))
                await asyncio.sleep(0 if time.monotonic() < spin_until else HOST_POLL_S)
            mailbox.result_flags[layer] = FLAG_EMPTY
        return AttentionState(mailbox.out[layer, :n], mailbox.lse[layer, :n])

    def release_step(self, step_id: int) -> bool:
        """The step's device work is past its deadline: every wait it queued on a mailbox ends
        (result flags ``ABORTED``, set from a stream of their own), and the step will fail in
        ``finish_step``. True where it had such waits."""
        released = False
        for (sid, _), step in self._steps.items():
            if sid != step_id or not step.opened.mailbox.is_cuda:
                continue
            if step.opened.link is not None:
                # Its receives end only with the link; the mailbox is dropped at finish_step.
                step.opened.link.abort_soon()
                step.released = released = True
                continue
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            flags = stream_flags()
            for layer in range(self.num_layers):
                flags.write(flag_address(step.opened.mailbox.result_flags, layer), FLAG_ABORTED, self._side_stream)
            step.released = released = True
        return released

    def step_failed(self, step_id: int) -> bool:
        return any(sid == step_id and _refused(step.reply) for (sid, _), step in self._steps.items())

    async def finish_step(self, step_id: int) -> None:
        """After the step's device work: every mailbox part's reply and status. Raises
        PeerPartFailed for the first part that did not come (its mailbox is dropped)."""
        failures: list[PeerPartFailed] = []
        for key in [k for k in self._steps if k[0] == step_id]:
            step = self._steps.pop(key)
            problem: Exception | None = None
            try:
                reply = await step.reply
                if not isinstance(reply, Ack):
                    problem = RuntimeError(reply.detail if isinstance(reply, ErrorReply) else
                                           f"answered {type(reply).__name__}")
            except TransportError as e:
                problem = e
            if problem is None and step.released:
                problem = TimeoutError(f"the step's parts did not come within {self.timeout_s} s")
            if problem is None and step.opened.link is not None and step.opened.link.aborted:
                problem = RuntimeError("the step's NCCL link was aborted")
            if problem is None and step.opened.link is None and int(step.opened.mailbox.status[0]) != STATUS_OK:
                problem = TimeoutError("the creditor gave the step up (its watchdog)")
            if problem is not None:
                self.steps_failed += 1
                self._drop(step.opened.inst_id, str(problem))
                failures.append(PeerPartFailed(step.peer.inst_id, step.peer.engine_id, problem))
        if failures:
            raise failures[0]

    def end_step(self, step_id: int) -> None:
        """The step's work is queued: creditors with a step queued ahead that this step did not
        attend over are told to let it go."""
        self.messages.end_step(step_id)
        self._stand_down_all_but({step.opened.inst_id for (sid, _), step in self._steps.items() if sid == step_id},
                                 step_id)

    def stand_down_all(self, step_id: int) -> None:
        """This home goes idle: no creditor keeps a step queued ahead for it."""
        self._stand_down_all_but(set(), step_id)

    def _stand_down_all_but(self, used: set[int], step_id: int) -> None:
        for opened in self._opened.values():
            if opened.ahead_key is not None and opened.inst_id not in used:
                self._stand_down(opened, step_id)

    def _stand_down(self, opened: _Opened, step_id: int) -> None:
        try:
            peer = self.peers.by_inst(opened.inst_id)
        except KeyError:
            return
        opened.ahead_key = None
        self.stand_downs += 1
        reply = asyncio.ensure_future(self.transport.request_soon(
            peer.address, StepStandDown(self.peers.own_inst_id, opened.mailbox_id, step_id), timeout_s=self.timeout_s))

        def answered(future: asyncio.Future) -> None:
            problem = _reply_problem(future) if _refused(future) else None
            if problem is not None and self._opened.get(opened.inst_id) is opened:
                # Whether a step is still queued there is not known: the mailbox is not used again.
                self._drop(opened.inst_id, f"its stand-down was not carried out: {problem}")
        reply.add_done_callback(answered)
        opened.standing_down = reply

    def abandon_step(self, step_id: int) -> None:
        """A step that failed before ``finish_step``: its mailboxes' flags no longer follow the
        protocol (queries flagged that no result answers), so they are dropped."""
        for key in [k for k in self._steps if k[0] == step_id]:
            step = self._steps.pop(key)
            if isinstance(step.reply, asyncio.Future):
                step.reply.add_done_callback(_retrieve)
            self._drop(step.opened.inst_id, "its step failed")

    def forget_peer(self, inst_id: int) -> None:
        self._drop(inst_id, "the peer is gone")

    async def close(self) -> None:
        for task in list(self._opening.values()):
            task.cancel()
        await asyncio.gather(*self._opening.values(), return_exceptions=True)
        for inst_id in list(self._opened):
            self._drop(inst_id, "this instance stops")
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _refused(reply: Awaitable) -> bool:
    """Whether a StepBegin's answer came and is not ``Ack``."""
    if not isinstance(reply, asyncio.Future) or not reply.done():
        return False
    return reply.cancelled() or reply.exception() is not None or not isinstance(reply.result(), Ack)


def _reply_problem(reply: asyncio.Future) -> str:
    if reply.cancelled():
        return "cancelled"
    if reply.exception() is not None:
        return str(reply.exception())
    result = reply.result()
    return result.detail if isinstance(result, ErrorReply) else f"answered {type(result).__name__}"
