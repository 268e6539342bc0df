"""Waiting for UCX requests on the event loop: spin briefly, then sleep on the worker's event fd.

ucxx's own ``Endpoint.send``/``recv`` await ``request.wait()``, which (without its notifier
thread) is a loop of ``await asyncio.sleep(0)`` until the request completes, in every progress
mode. A transport always keeps a header receive posted on each connection, so that loop never
ends and the process spins a core even when no message moves. Two such processes that share a
core (a 2-core host running anything else, or an oversubscribed GPU node) then take turns: a
frame waits for its receiver's next scheduler time slice, 4-12 ms, instead of microseconds.

``UcxProgress.wait(request)`` progresses the worker and spins for at most ``spin_s`` (a reply
that is already on its way arrives within that), then arms the worker and lets the event loop
sleep until the worker's epoll fd reports an event. An idle transport costs no CPU, and a
process that sleeps is woken by the kernel as soon as a message arrives.

The worker is armed, and its fd watched, only while a request sleeps here: an armed worker
makes the fd readable at the next event, and the event loop then runs a progress of its own for
each message that a spinning wait has already seen (on the development CPU a 1 KiB round trip
took 72 us with the worker armed after every wait, 63 us without). A fired fd stays readable
until the worker is armed again, so with nothing asleep it is not watched at all.

ucxx must run in ``blocking`` progress mode (it creates the epoll fd and no progress thread):
all progress then happens on the event loop's thread, here.
"""

from __future__ import annotations

import asyncio
import time

# A periodic progress and re-arm: a safety net against a lost wake-up (ucxx itself progresses
# the worker in places without arming it again, e.g. when it creates an endpoint). Costs ~1% of
# a core while idle.
SAFETY_TICK_S = 0.01


class UcxProgress:
    """Completes UCX requests of one worker on one event loop."""

    def __init__(self, worker, loop: asyncio.AbstractEventLoop, spin_s: float) -> None:
        self._worker = worker
        self._loop = loop
        self.spin_s = spin_s
        self._sleepers: list[tuple[object, asyncio.Future, object]] = []  # request, future, ring
        self._tick: asyncio.TimerHandle | None = None
        self._fd = worker.epoll_file_descriptor
        # Replaces the reader of ucxx's blocking mode on the same fd (which only progresses):
        # this one also wakes the requests that sleep here, and arms the worker again. It is
        # watched only while a request sleeps: a fired fd stays readable until the worker is
        # armed, and arming while nothing sleeps is what this saves.
        self._watching = False
        self._watch(True)
        self._tick = loop.call_later(SAFETY_TICK_S, self._on_tick)

    async def wait(self, request, deadline: float | None = None, ring=None) -> None:
        """Until ``request`` completes; raises its error (UCXError subclasses) if it failed, or
        TimeoutError once ``time.monotonic()`` passes ``deadline`` (None: no limit).

        With ``ring`` (a peer's ``PeerHeaderRing``) it also returns once the ring holds a
        header, the request still pending, and a sleeping wait wakes at the ring's doorbell:
        the caller looks at both again.

        The deadline is checked while spinning and armed as one timer only once the wait goes
        to sleep: most waits end within the spin, and a timer per wait (``asyncio.timeout``)
        would cost more than the wait itself.
        """
        worker = self._worker
        if not request.completed:
            worker.progress()
        if not request.completed and not (ring is not None and ring.has_frame()):
            spin_until = time.monotonic() + self.spin_s
            while True:
                await asyncio.sleep(0)
                if ring is not None and ring.has_frame():  # looked at first: no system call
                    break
                worker.progress()
                if self._sleepers:  # this progress may have completed a sleeper's request
                    self._wake_completed()
                if request.completed:
                    break
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError()
                if now >= spin_until:
                    await self._sleep(request, deadline, ring)
                    break
        if self._sleepers:  # the spin's progress may have taken the event they sleep on
            self._wake_completed()
            self._arm()
        if request.completed:
            request.check_error()

    async def _sleep(self, request, deadline: float | None, ring=None) -> None:
        loop = self._loop
        future = loop.create_future()
        entry = (request, future, ring)
        if ring is not None:
            if ring.closed:  # its connection was aborted: the request has ended too
                return
            # Emptied before the ring is looked at: a header written after that look rings a
            # bell that is then still there to wake this wait.
            ring.drain_bell()
            if ring.has_frame():
                return
            ring.watch(loop, future)
        self._sleepers.append(entry)
        self._watch(True)
        timer = None
        if deadline is not None:
            timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), _expire, future)
        self._arm()
        try:
            await future
        finally:
            if timer is not None:
                timer.cancel()
            if ring is not None:
                ring.unwatch()
            try:  # still listed when cancelled or timed out
                self._sleepers.remove(entry)
            except ValueError:
                pass

    def _arm(self) -> None:
        """Arm the worker so that its fd reports the next event. ``arm`` refuses while events
        are pending; those are progressed first (which may complete sleeping requests)."""
        worker = self._worker
        while not worker.arm():
            worker.progress()
            self._wake_completed()

    def _wake_completed(self) -> None:
        if not self._sleepers:
            return
        still = []
        for entry in self._sleepers:
            request, future, ring = entry
            if request.completed or (ring is not None and ring.has_frame()):
                if not future.done():
                    future.set_result(None)
            elif not future.done():
                still.append(entry)
        self._sleepers = still

    def _on_event(self) -> None:
        self._worker.progress()
        self._wake_completed()
        if self._sleepers:
            self._arm()
        else:  # nothing sleeps: stop watching the fd rather than arm it
            self._watch(False)

    def poke(self) -> None:
        """Progress now and wake what completed (e.g. after an endpoint was aborted)."""
        self._on_event()

    def _on_tick(self) -> None:
        self._on_event()
        self._tick = self._loop.call_later(SAFETY_TICK_S, self._on_tick)

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._watch(False)

    def _watch(self, on: bool) -> None:
        """Watch the worker's fd from the event loop, or stop."""
        if on and not self._watching:
            self._loop.add_reader(self._fd, self._on_event)
        elif not on and self._watching:
            self._loop.remove_reader(self._fd)
        self._watching = on


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
