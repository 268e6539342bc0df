"""The creditor's side of the step protocol: a home's whole step served from its mailbox.

A home of this host opens one mailbox here (``StepMailboxOpen``), then sends one
``StepBegin`` per decode step. The step's plan is the one ``CreditorAttention`` makes for an
attend request of the same slices (kept from step to step, its tables rewritten in place), and
its layers are queued at once:

- on a GPU, on a stream of the mailbox's own (the highest priority): per layer, a stream wait
  for the layer's query flag, the attention, the result and its flag. The first step of a plan
  runs eagerly (which also compiles its kernels); the next ones replay the same work captured
  as one CUDA graph. The stream waits occupy no multiprocessor: this instance's own steps, and
  other homes' mailboxes, run on beside them.
- on the host, on a thread of the mailbox's own, which polls the flags.

A ``StepBegin`` with ``ahead = 1`` also queues the next step of the same slices and rows behind
it, waiting for its first query like any step: the home's next step finds its layers queued
before its ``StepBegin`` arrives, and that message only assigns the step queued ahead (and
queues the one after). A ``StepBegin`` of other slices, or a ``StepStandDown``, lets the step
queued ahead go: on a GPU its query flags are set from a side stream, so that it runs through
on the stale queries, and its result flags are emptied behind it on the mailbox's stream; on the
host it is dropped unrun. The home awaits the answer of such a ``StepBegin`` before it writes
a query of that step, and it accepts no step's results before its ``StepBegin``'s ``Ack``: a
step queued ahead whose plan changed meanwhile (the home's segments here changed) is refused
there and its mailbox given up.

A home on another host (or one that asks for it) opens a *link* instead
(``StepMailboxOpen.nccl_id``): the mailbox stays in this process's memory and each layer's
query comes in, and its result goes out, by NCCL point-to-point on the mailbox's stream
(``transport/nccl_link.py``), captured in the step's graph as the flags are. A send waits for
its matching receive, so a link needs no step queued ahead: its home's step starts at once and
its first query waits on the device until this step is queued. No step is queued ahead on a
link (a queued receive cannot be let go without its home's send), and one given up is ended by
aborting the link.

A step that is not over by its deadline (``timeout_s`` from its ``StepBegin``: the home died,
or stopped mid-step) is given up by the watchdog (``check_deadlines``, called by the daemon
every fraction of the timeout): the mailbox's status says so, its query flags are set
``ABORTED`` so that every wait ends, and the mailbox is freed once its work is done. Its home,
if alive, reads the status at the end of the step and fails the step rather than merge parts
computed from stale queries.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from infinite_llm.kernels import AttentionState, MicroAttentionPlan, run_micro_attention
from infinite_llm.transport import graph_capture
from infinite_llm.transport.messages import (
    Ack,
    ErrorCode,
    ErrorReply,
    Message,
    StepBegin,
    StepMailboxClose,
    StepMailboxOpen,
    StepMailboxOpened,
    StepStandDown,
)
from infinite_llm.transport.nccl_link import NcclLink, NcclUnavailable
from infinite_llm.transport.step_mailbox import (
    FLAG_ABORTED,
    OTHER_HOST,
    FLAG_EMPTY,
    FLAG_READY,
    STATUS_TIMED_OUT,
    Mailbox,
    MailboxUnavailable,
    flag_address,
    layout_of,
    make_local_mailbox,
    make_mailbox,
    remove_host_file,
    stream_flags,
)
from infinite_llm.transport.tensors import TORCH_DTYPE_NAMES

from .creditor import AttendError, CreditorAttention

log = logging.getLogger(__name__)

# Mailboxes kept at once, over every home: a home keeps one per creditor.
MAX_MAILBOXES = 64
# How long a StepBegin waits for the home's last step to be marked over here, s: the home saw its
# last result, so only the worker's (or stream's) last instructions are left.
LAST_STEP_GRACE_S = 0.05
# How long a StepBegin on a link waits for the link's making to end here, s: its home made
# its end of the link, which returns once both ends joined.
LINK_READY_GRACE_S = 1.0
# A host worker's poll: spins this long, then sleeps this long between looks, s.
HOST_SPIN_S = 0.002
HOST_POLL_S = 0.0002


class StepRefused(AttendError):
    """A ``StepBegin`` that names a mailbox that is not here, or segments that are not held."""


@dataclass
class _Step:
    step_id: int  # -1 while queued ahead, not yet a step of the home's
    deadline: float  # on the server's clock (inf while queued ahead)
    done: torch.cuda.Event | threading.Event  # the step's last layer is over
    key: tuple = ()  # (slices, rows) it was queued for
    plan: object = None  # the planner's plan it was queued over
    let_go: threading.Event = field(default_factory=threading.Event)  # a host step queued ahead, not to run


@dataclass
class _Served:
    """One home's mailbox, kept until the home closes it, dies or a step times out."""

    mailbox_id: int
    home_inst_id: int
    mailbox: Mailbox
    host_path: str
    stream: torch.cuda.Stream | None  # a GPU mailbox's stream
    graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, MicroAttentionPlan]] = field(default_factory=dict)
    eager: set[tuple[int, int]] = field(default_factory=set)  # (plan, rows) served once without a graph
    graph_pool: tuple | None = None
    step: _Step | None = None  # the home's last step
    ahead: _Step | None = None  # queued behind it for the home's next step
    last_step_id: int = -1
    last_begin: float = 0.0  # on the server's clock
    side_stream: torch.cuda.Stream | None = None  # for flags set while the mailbox's stream waits
    retired_steps: list = field(default_factory=list)  # steps still queued when it was given up
    worker: threading.Thread | None = None
    work: queue.Queue | None = None  # a host mailbox's steps: (plan, num_rows, _Step), None to stop
    abort: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    # A home on another host: the per-layer exchange by NCCL, not through shared memory.
    on_link: bool = False
    link: NcclLink | None = None  # once made
    link_made: threading.Event = field(default_factory=threading.Event)  # made, or failed to be
    link_problem: str = ""


class StepServer:
    """Serves ``StepMailboxOpen``, ``StepBegin`` and ``StepMailboxClose`` from the planner's
    pool and ledger (a ``CreditorAttention`` of its own: its plans are this server's)."""

    def __init__(self, planner: CreditorAttention, *, host_id: str, timeout_s: float,
                 host_dir: Path | None = None, clock: Callable[[], float] = time.monotonic,
                 cuda_graphs: bool = True, max_mailboxes: int = MAX_MAILBOXES, nccl_links: bool = True) -> None:
        self.planner = planner
        self.pool = planner.kv_pool
        self.host_id = host_id
        self.timeout_s = timeout_s
        self.host_dir = host_dir
        self.clock = clock
        self.cuda_graphs = cuda_graphs and self.pool.is_cuda
        self.max_mailboxes = max_mailboxes
        self.nccl_links = nccl_links and self.pool.is_cuda
        self._served: dict[int, _Served] = {}  # mailbox id -> it
        self._retired: list[_Served] = []  # given up, freed once their work is done
        self._ids = itertools.count(1)
        self.steps_begun = 0
        self.graph_replays = 0
        self.timeouts = 0  # steps given up by the watchdog
        self.steps_assigned_ahead = 0  # steps whose layers were queued before their StepBegin came
        self.steps_let_go = 0  # steps queued ahead that no step used
        self.links_made = 0  # NCCL links with homes (of other hosts), made

    @property
    def num_mailboxes(self) -> int:
        return len(self._served)

    # ---- messages --------------------------------------------------------------------------
    def handle(self, message: StepMailboxOpen | StepBegin | StepStandDown | StepMailboxClose) -> Message | None:
        """The answer to one of the step protocol's messages: a refusal is an ErrorReply
        (step_mailbox_unavailable, step_refused), never a failure of the handler."""
        if isinstance(message, (StepBegin, StepStandDown)):
            try:
                return self.begin(message) if isinstance(message, StepBegin) else self.stand_down(message)
            except AttendError as exc:
                return ErrorReply(ErrorCode.STEP_REFUSED, str(exc))
        if isinstance(message, StepMailboxOpen):
            try:
                return self.open(message)
            except MailboxUnavailable as exc:
                return ErrorReply(ErrorCode.STEP_MAILBOX_UNAVAILABLE, str(exc))
        if isinstance(message, StepMailboxClose):
            self.close(message)
            return None
        raise TypeError(f"{type(message).__name__} is not a message of the step protocol")

    def open(self, message: StepMailboxOpen) -> StepMailboxOpened:
        """A new mailbox for the home (replacing its earlier one). MailboxUnavailable where the
        home is on another host (and asks for no NCCL link), NCCL is not here, or its model is
        not this pool's. A link is made on a thread of its own, as the home makes its end."""
        if message.nccl_id and not self.nccl_links:
            raise MailboxUnavailable("no NCCL links here" + ("" if self.pool.is_cuda else ": the pool is on the host"))
        if message.host_id != self.host_id and not message.nccl_id:
            raise MailboxUnavailable(OTHER_HOST)
        _, num_layers, _, _, num_kv_heads, head_dim = self.pool.shape
        dtype = TORCH_DTYPE_NAMES.get(self.pool.dtype)
        if (message.num_layers, message.head_dim, message.dtype) != (num_layers, head_dim, dtype) \
                or message.num_heads != self.planner.num_heads:
            raise MailboxUnavailable(
                f"the home's model ({message.num_layers} layers, {message.num_heads} heads of {message.head_dim}, "
                f"{message.dtype}) is not this pool's ({num_layers}, {self.planner.num_heads} of {head_dim}, {dtype})")
        try:
            layout = layout_of(message.num_layers, message.max_rows, message.num_heads, message.head_dim, message.dtype)
        except ValueError as e:
            raise MailboxUnavailable(str(e)) from None
        for served in [s for s in self._served.values() if s.home_inst_id == message.home_inst_id]:
            self._retire(served, "the home opened another")
        if len(self._served) >= self.max_mailboxes:
            raise MailboxUnavailable(f"{self.max_mailboxes} mailboxes are open here")
        mailbox_id = next(self._ids)
        if message.nccl_id:
            served = self._open_link(message, layout, mailbox_id)
            log.info("step link %d opened for instance %d (NCCL, %d bytes)", mailbox_id, message.home_inst_id,
                     layout.nbytes)
            return StepMailboxOpened(mailbox_id, layout.nbytes, (), "", nccl=True)
        mailbox, offer, host_path = make_mailbox(layout, self.pool.device, mailbox_id, self.host_dir)
        served = _Served(mailbox_id, message.home_inst_id, mailbox, host_path,
                         torch.cuda.Stream(self.pool.device, priority=-16) if self.pool.is_cuda else None)
        if served.stream is None:
            served.work = queue.Queue()
            served.worker = threading.Thread(target=self._host_worker, args=(served,), daemon=True,
                                             name=f"step-mailbox-{mailbox_id}")
            served.worker.start()
        self._served[mailbox_id] = served
        log.info("step mailbox %d opened for instance %d (%d bytes, %s)", mailbox_id, message.home_inst_id,
                 layout.nbytes, "device" if offer is not None else host_path)
        return StepMailboxOpened(mailbox_id, layout.nbytes, (offer,) if offer is not None else (), host_path)

    def _open_link(self, message: StepMailboxOpen, layout, mailbox_id: int) -> _Served:
        try:
            unique_id = bytes.fromhex(message.nccl_id)
        except ValueError:
            raise MailboxUnavailable("nccl_id is not hex") from None
        served = _Served(mailbox_id, message.home_inst_id, make_local_mailbox(layout, self.pool.device), "",
                         torch.cuda.Stream(self.pool.device, priority=-16), on_link=True)

        def make() -> None:
            try:
                link = NcclLink(unique_id, 1, self.pool.device)
            except (NcclUnavailable, OSError) as e:
                served.link_problem = str(e)
                log.warning("step link %d of instance %d: %s", mailbox_id, message.home_inst_id, e)
            else:
                if served.aborted or self._served.get(mailbox_id) is not served:
                    link.abort()  # given up while it was being made
                else:
                    served.link = link
                    self.links_made += 1
            finally:
                served.link_made.set()
        self._served[mailbox_id] = served
        # Blocks until the home made its end: off the event loop.
        threading.Thread(target=make, daemon=True, name=f"step-link-{mailbox_id}").start()
        return served

    def begin(self, message: StepBegin) -> Ack:
        """Queue the step's layers (or assign it the step queued ahead for it), and the next
        one's where ``message.ahead``. StepRefused where the mailbox is not here, the step is
        not the mailbox's, its slices name segments not held here, or the step queued ahead for
        it is stale (the home then fails the step and attends by messages)."""
        served = self._served.get(message.mailbox_id)
        if served is None or served.home_inst_id != message.home_inst_id:
            raise StepRefused(f"mailbox {message.mailbox_id} of instance {message.home_inst_id} is not open here")
        layout = served.mailbox.layout
        if message.num_layers != layout.num_layers or message.num_rows > layout.max_rows:
            raise StepRefused(f"a step of {message.num_layers} layers and {message.num_rows} rows for a mailbox of "
                              f"{layout.num_layers} and {layout.max_rows}")
        if served.on_link:
            if not served.link_made.wait(LINK_READY_GRACE_S) or served.link is None:
                problem = served.link_problem or f"not made within {LINK_READY_GRACE_S} s"
                self._retire(served, f"its NCCL link failed: {problem}")
                raise StepRefused(f"step {message.step_id}: the NCCL link of mailbox {message.mailbox_id}: {problem}")
            if message.wire_rows < message.num_rows or message.wire_rows > layout.max_rows:
                raise StepRefused(f"step {message.step_id}: {message.wire_rows} rows on the wire for "
                                  f"{message.num_rows} rows and a mailbox of {layout.max_rows}")
            message = replace(message, ahead=0)  # a receive queued ahead could not be let go
        now = self.clock()
        served.last_begin = now
        served.last_step_id = max(served.last_step_id, message.step_id)
        key = (message.slices, message.num_rows)
        ahead = served.ahead
        if ahead is not None and ahead.key == key:
            if not self.planner.plan_is_current(message.home_inst_id, ahead.plan, message.slices):
                # Its home may be running it already, over tables that are no longer right.
                self._retire(served, f"step {message.step_id} was queued ahead over segments that changed since")
                raise StepRefused(f"step {message.step_id}: the segments it attends over changed while it was "
                                  "queued ahead")
            served.ahead = None
            ahead.step_id, ahead.deadline = message.step_id, now + self.timeout_s
            served.step = ahead
            self.steps_assigned_ahead += 1
        else:
            if served.step is not None and not _done_within(served.step.done, LAST_STEP_GRACE_S):
                # Steps of a home are one at a time: the home began this one before the last was over.
                self._retire(served, f"step {message.step_id} began before step {served.step.step_id} was over")
                raise StepRefused(f"step {message.step_id} began while step {served.step.step_id} ran")
            if ahead is not None:
                self._let_go_ahead(served)
            served.step = self._queue_step(served, message, message.step_id, now + self.timeout_s)
        if message.ahead:
            served.ahead = self._queue_step(served, message, -1, math.inf)
        self.steps_begun += 1
        return Ack()

    def stand_down(self, message: StepStandDown) -> Ack:
        """Let the step queued ahead go (none: nothing to do). A stand-down older than the
        home's last StepBegin here is one that came late: that StepBegin decided already."""
        served = self._served.get(message.mailbox_id)
        if served is None or served.home_inst_id != message.home_inst_id:
            raise StepRefused(f"mailbox {message.mailbox_id} of instance {message.home_inst_id} is not open here")
        if message.step_id >= served.last_step_id:
            self._let_go_ahead(served)
        return Ack()

    def _queue_step(self, served: _Served, message: StepBegin, step_id: int, deadline: float) -> _Step:
        step = _Step(step_id, deadline, torch.cuda.Event() if served.stream is not None else threading.Event(),
                     key=(message.slices, message.num_rows))
        if served.stream is None:
            step.plan = self.planner.plan_for(message.home_inst_id, message.slices)
            served.work.put((step.plan, message.num_rows, step))
        else:
            with torch.cuda.stream(served.stream):
                # The plan's tables are rewritten on this stream: after the last step's layers.
                step.plan = self.planner.plan_for(message.home_inst_id, message.slices)
                self._queue_layers(served, step.plan.plan, message.num_rows,
                                   message.wire_rows if served.on_link else 0)
                step.done.record(served.stream)
        return step

    def _let_go_ahead(self, served: _Served) -> None:
        """The step queued ahead will get no query: on a GPU it runs through on the stale ones
        (its query flags set from a side stream) and its result flags are emptied behind it;
        on the host it is dropped unrun. Its home writes no query meanwhile: it waits for the
        answer to the message that got here."""
        ahead, served.ahead = served.ahead, None
        if ahead is None:
            return
        self.steps_let_go += 1
        if served.stream is None:
            ahead.let_go.set()
            return
        flags = stream_flags()
        mailbox = served.mailbox
        if served.side_stream is None:
            served.side_stream = torch.cuda.Stream(self.pool.device)
        _release_query_waits(mailbox, 1, served.side_stream)
        emptied = torch.cuda.Event()
        with torch.cuda.stream(served.stream):
            for layer in range(mailbox.layout.num_layers):
                flags.write(flag_address(mailbox.result_flags, layer), FLAG_EMPTY)
            emptied.record()
        # Before the answer leaves: once the home has it, it writes its next query, which the
        # step let go must not take, and waits on result flags, which it must not have set.
        # (It waits on nothing of the home's: its flags are set from the side stream.)
        emptied.synchronize()

    def close(self, message: StepMailboxClose) -> None:
        served = self._served.get(message.mailbox_id)
        if served is not None and served.home_inst_id == message.home_inst_id:
            self._retire(served, "the home closed it")

    def forget(self, home_inst_id: int) -> None:
        """The home is gone: its mailboxes are given up."""
        for served in [s for s in self._served.values() if s.home_inst_id == home_inst_id]:
            self._retire(served, f"instance {home_inst_id} is gone")

    def close_all(self) -> None:
        for served in list(self._served.values()):
            self._retire(served, "this instance stops")
        self._free_retired()

    # ---- the watchdog -------------------------------------------------------------------------
    def check_deadlines(self) -> list[tuple[int, int]]:
        """Give up every step past its deadline; free retired mailboxes whose work is done.
        Returns (home, step id) of each step given up now."""
        now = self.clock()
        given_up = []
        for served in list(self._served.values()):
            step = served.step
            if step is None or _is_done(step.done):
                if served.ahead is not None and now >= served.last_begin + self.timeout_s:
                    # A home that went quiet without standing down (it stopped, or its
                    # stand-down was lost): the step queued ahead would wait for ever.
                    self._retire(served, f"its step queued ahead was not used within {self.timeout_s:.1f} s")
                continue
            if now >= step.deadline:
                given_up.append((served.home_inst_id, step.step_id))
                self.timeouts += 1
                log.warning("step %d of instance %d did not end within %.1f s: mailbox %d given up",
                            step.step_id, served.home_inst_id, self.timeout_s, served.mailbox_id)
                self._retire(served, "its step timed out")
        self._free_retired()
        return given_up

    def _retire(self, served: _Served, why: str) -> None:
        """Stop using ``served``: its waits are released (status TIMED_OUT where a step is in
        flight, so its home merges nothing of it), and it is freed once its work is done."""
        self._served.pop(served.mailbox_id, None)
        queued = [st for st in (served.step, served.ahead) if st is not None and not _is_done(st.done)]
        in_flight = bool(queued)
        mailbox = served.mailbox
        if served.on_link:
            # Its queued receives and sends end with the link (NCCL has no other way out), and
            # its home's, which it sees closed, end by its own watchdog or close.
            served.aborted = True
            if served.link is not None:
                served.link.abort_soon()
        elif served.stream is not None:
            if in_flight:
                flags = stream_flags()
                side = torch.cuda.Stream(self.pool.device)
                # Not on the mailbox's stream, which is the one waiting.
                flags.write(mailbox.status.data_ptr(), STATUS_TIMED_OUT, side)
                _release_query_waits(mailbox, len(queued), side)
        else:
            served.abort.set()
            served.work.put(None)
        served.retired_steps, served.ahead = queued, None
        served.aborted = served.aborted or in_flight
        remove_host_file(served.host_path)  # the mappings stay valid until their memory is dropped
        log.info("step mailbox %d of instance %d closed: %s", served.mailbox_id, served.home_inst_id, why)
        self._retired.append(served)
        self._free_retired()

    def _free_retired(self) -> None:
        kept = []
        for served in self._retired:
            if any(st is not None and not _is_done(st.done) for st in served.retired_steps):
                kept.append(served)  # its memory stays mapped (here) until its work is over
        self._retired = kept

    # ---- the layers -------------------------------------------------------------------------
    def _queue_layers(self, served: _Served, plan: MicroAttentionPlan, num_rows: int, wire_rows: int = 0) -> None:
        """The step's layers on ``served.stream`` (current): eagerly the first time a plan
        serves this many rows, then from the graph captured the second time. ``wire_rows``:
        the rows each layer's transfers carry on a link."""
        key = (id(plan), num_rows, wire_rows)
        captured = served.graphs.get(key)
        if captured is not None and captured[1] is plan:
            captured[0].replay()
            self.graph_replays += 1
            return
        if self.cuda_graphs and key in served.eager:
            # A plan replaced takes its graphs with it (keys of plans no longer kept are dropped).
            served.graphs = {k: v for k, v in served.graphs.items() if v[1] is plan}
            served.graph_pool = graph_capture.pool_for_capture(served.graph_pool, held=bool(served.graphs))
            graph = torch.cuda.CUDAGraph()
            try:
                graph_capture.capture(graph, served.graph_pool,
                                      lambda: self._layers(served, plan, num_rows, wire_rows))
            except Exception as exc:  # noqa: BLE001  (serving goes on, eagerly)
                log.warning("step mailbox %d: capturing the step failed, serving eagerly: %s", served.mailbox_id, exc)
                self.cuda_graphs = False
            else:
                served.graphs[key] = (graph, plan)
                graph.replay()
                self.graph_replays += 1
                return
        if key not in served.eager:
            # Once per plan and row count, before any wait is queued: the layers' kernels run
            # once and the host waits for them. CUDA loads a kernel's module at its first launch
            # (lazy loading, the default) and that load waits for the device's streams: launched
            # behind a wait on a query that the home sends only once this step is acknowledged,
            # the first launch would wait for the home, and the home for it. (The slot's result
            # is overwritten by the step itself before its flag says it is there.)
            self._attend(served.mailbox, plan, 0, num_rows)
            torch.cuda.current_stream().synchronize()
        self._layers(served, plan, num_rows, wire_rows)
        served.eager = {k for k in served.eager if k[0] == id(plan)} | {key}

    def _layers(self, served: _Served, plan: MicroAttentionPlan, num_rows: int, wire_rows: int) -> None:
        mailbox = served.mailbox
        if served.on_link:
            link = served.link
            for layer in range(mailbox.layout.num_layers):
                link.recv(mailbox.q[layer, :wire_rows])
                self._attend(mailbox, plan, layer, num_rows)
                with link.group():  # rows past num_rows carry what they held: the home drops them
                    link.send(mailbox.out[layer, :wire_rows])
                    link.send(mailbox.lse[layer, :wire_rows])
            return
        flags = stream_flags()
        for layer in range(mailbox.layout.num_layers):
            q_flag = flag_address(mailbox.q_flags, layer)
            flags.wait(q_flag, FLAG_READY)
            flags.write(q_flag, FLAG_EMPTY)
            self._attend(mailbox, plan, layer, num_rows)
            flags.write(flag_address(mailbox.result_flags, layer), FLAG_READY)

    def _attend(self, mailbox: Mailbox, plan: MicroAttentionPlan, layer: int, num_rows: int) -> None:
        # Written into the result slots by the kernels themselves: no copy between the
        # attention and the flag the home waits on.
        run_micro_attention(plan, mailbox.q[layer, :num_rows], self.pool, layer,
                            sm_scale=self.planner.sm_scale, out_dtype=mailbox.out.dtype,
                            into=AttentionState(mailbox.out[layer, :num_rows], mailbox.lse[layer, :num_rows]))

    def _host_worker(self, served: _Served) -> None:
        """A host mailbox's steps, one at a time, on this thread: the event loop's thread only
        queues them, and serves on while the layers run."""
        mailbox = served.mailbox
        try:
            while True:
                item = served.work.get()
                if item is None:
                    return
                plan, num_rows, step = item
                try:
                    if not self._host_step(served, plan, num_rows, step):
                        return
                finally:
                    step.done.set()
        finally:
            while True:  # the steps left queued will not run: none is waited for
                try:
                    item = served.work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[2].done.set()

    def _host_step(self, served: _Served, plan, num_rows: int, step: _Step) -> bool:
        """One step's layers; False where the mailbox is done with (given up, failed)."""
        mailbox = served.mailbox
        try:
            for layer in range(mailbox.layout.num_layers):
                waited = self._host_wait(served, layer, step)
                if waited is None:
                    return True  # a step queued ahead that was let go: nothing of it ran
                if not waited:
                    mailbox.status[0] = STATUS_TIMED_OUT
                    mailbox.result_flags[layer:] = FLAG_ABORTED  # the home's waits end too
                    return False
                mailbox.q_flags[layer] = FLAG_EMPTY
                self._attend(mailbox, plan.plan, layer, num_rows)
                mailbox.result_flags[layer] = FLAG_READY
        except Exception:  # noqa: BLE001  (the home's wait ends; its step fails on the status)
            log.exception("step mailbox %d: step %d failed", served.mailbox_id, step.step_id)
            mailbox.status[0] = STATUS_TIMED_OUT
            mailbox.result_flags[:] = FLAG_ABORTED
            return False
        return True

    def _host_wait(self, served: _Served, layer: int, step: _Step) -> bool | None:
        """Until the layer's query is in (True), the mailbox is given up or the step's deadline
        passed (False), or the step, queued ahead, was let go before its first query (None)."""
        flags = served.mailbox.q_flags
        spin_until = time.monotonic() + HOST_SPIN_S
        while True:
            # Let go before its answer left: a query seen after that is the next step's.
            if layer == 0 and step.let_go.is_set():
                return None
            if int(flags[layer]) >= FLAG_READY:
                if layer == 0 and step.let_go.is_set():
                    return None
                break
            if served.abort.is_set() or self.clock() >= step.deadline:
                return False
            if time.monotonic() < spin_until:
                time.sleep(0)
            else:
                served.abort.wait(HOST_POLL_S)
        return not served.abort.is_set() or int(flags[layer]) == FLAG_READY


def _release_query_waits(mailbox: Mailbox, num_steps: int, stream: torch.cuda.Stream) -> None:
    """Queue on ``stream`` (not the mailbox's, which is the one waiting) what lets the
    ``num_steps`` steps queued on a device mailbox pass every layer's query wait: each flag set
    ``ABORTED`` once per step. Each step empties a query flag once it has passed it, so every
    round after the first waits for that first."""
    flags = stream_flags()
    for round_ in range(num_steps):
        for layer in range(mailbox.layout.num_layers):
            q_flag = flag_address(mailbox.q_flags, layer)
            if round_:
                flags.wait_equal(q_flag, FLAG_EMPTY, stream)
            flags.write(q_flag, FLAG_ABORTED, stream)


def _done_within(done: torch.cuda.Event | threading.Event, seconds: float) -> bool:
    """Whether ``done`` is, or becomes within ``seconds``: a home that has read a step's last
    result may begin the next one before the creditor's worker (or stream) marked it over."""
    if isinstance(done, threading.Event):
        return done.wait(seconds)
    deadline = time.monotonic() + seconds
    while not done.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0001)
    return True


def _is_done(done: torch.cuda.Event | threading.Event) -> bool:
    return done.is_set() if isinstance(done, threading.Event) else done.query()
