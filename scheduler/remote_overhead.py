"""The remote-attention overhead the cluster shows, learnt from the instances' heartbeats.

The performance model's ``remote_overhead_s`` is what a layer with remote parts costs a home
beyond the attention itself: sending the query, the creditor's reply, the merge. A calibration
run measures it once; on a running cluster it is whatever the transport and the hosts make of
it (on the H200 machines, 1-2.5 ms a layer against a calibrated 0.07 ms). Each heartbeat carries
the home's waits for creditors' parts (from sending the query to resuming with the reply) and
the creditor's time serving attend requests since the previous one; the overhead is the mean
wait less the mean serving time, over a sliding window. On a GPU the home's own attention is
only launched while it waits, so the wait is the round trip; where that attention runs on the
host thread (the CPU), the wait also covers it, and the estimate is an upper bound.

Pure: no clock of its own, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["RemoteOverheadWindow"]


@dataclass(frozen=True)
class _Sample:
    at_s: float
    wait_us: int
    waits: int
    serve_us: int
    serves: int


class RemoteOverheadWindow:
    """Sums of the heartbeats' remote-attention figures over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0, min_waits: int = 64) -> None:
        if window_s <= 0 or min_waits < 1:
            raise ValueError("window_s must be > 0 and min_waits >= 1")
        self.window_s = window_s
        self.min_waits = min_waits  # fewer waits than this in the window: the last estimate holds
        self._samples: deque[_Sample] = deque()
        self._last_s: float | None = None

    def add(self, now_s: float, wait_us: int, waits: int, serve_us: int, serves: int) -> None:
        """One heartbeat's figures (sums since the sender's previous heartbeat)."""
        if min(wait_us, waits, serve_us, serves) < 0:
            raise ValueError("remote-attention figures must be >= 0")
        if waits or serves:
            self._samples.append(_Sample(now_s, wait_us, waits, serve_us, serves))
        self._forget(now_s)

    def estimate_s(self, now_s: float) -> float | None:
        """The mean wait for a creditor's part less the mean serving time per attend request,
        seconds (at least 0), over the window. While the window holds fewer than ``min_waits``
        waits, the last such estimate (None before the first): a policy that stopped splitting
        requests because they cost this much must not forget it once none are split. Without
        any serving time in the window the wait counts whole."""
        self._forget(now_s)
        waits = sum(s.waits for s in self._samples)
        if waits < self.min_waits:
            return self._last_s
        serves = sum(s.serves for s in self._samples)
        mean_wait_s = sum(s.wait_us for s in self._samples) / waits * 1e-6
        mean_serve_s = sum(s.serve_us for s in self._samples) / serves * 1e-6 if serves else 0.0
        self._last_s = max(0.0, mean_wait_s - mean_serve_s)
        return self._last_s

    def _forget(self, now_s: float) -> None:
        while self._samples and self._samples[0].at_s < now_s - self.window_s:
            self._samples.popleft()
