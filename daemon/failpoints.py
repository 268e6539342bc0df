"""Failpoints: named places in a move where a fault test has this process kill itself.

A fault test must kill a process at a chosen stage of a KV move (after the destination reserved,
after it stored the data, while the source forwards a segment...), which a signal sent from
outside can only hit by chance: the stages last milliseconds. ``INFLLM_FAILPOINTS``, read once
when the process starts, arms some of them: ``name=n[,name=n...]`` makes the n-th pass through
``name`` end the process with SIGKILL, as ``kill -9`` would (no cleanup, no goodbye to peers).
Unset, as in every deployment, :func:`reached` is a dictionary lookup that finds nothing.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

ENV = "INFLLM_FAILPOINTS"

# Where a move can be cut; each name is passed once per move (per piece, for a home's spill).
FAILPOINTS = (
    "move.reserved",  # a destination reserved blocks for a move (TryMoveKV), before it answers
    "move.stored",  # a destination stored (and, for a home's own move, committed) the data, before it answers
    "move.committed",  # a destination committed a creditor-to-creditor copy (MoveCommit)
    "forward.begin",  # a source creditor is asked to forward a held segment, before it sends
    "forward.sent",  # a source creditor's destination stored the segment, before the source answers
    "home.sent",  # the home's move piece is committed at the destination, before the home switches
    "apb.layer",  # a host of an APB prefill begins a layer of its chunk (passed once per layer)
)


def parse(spec: str) -> dict[str, int]:
    """``name=n,...`` -> {name: n}; ValueError naming what is wrong."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("=")
        if name not in FAILPOINTS:
            raise ValueError(f"{ENV}: no failpoint {name!r}; there are {', '.join(FAILPOINTS)}")
        try:
            armed[name] = int(count or "1")
        except ValueError:
            raise ValueError(f"{ENV}: {item!r}: the count after '=' must be an integer") from None
        if armed[name] < 1:
            raise ValueError(f"{ENV}: {item!r}: the count must be at least 1")
    return armed


_armed: dict[str, int] = parse(os.environ.get(ENV, ""))


def reached(name: str) -> None:
    """Pass through failpoint ``name``: at its armed count, the process ends here with SIGKILL."""
    left = _armed.get(name)
    if left is None:
        return
    if left > 1:
        _armed[name] = left - 1
        return
    log.critical("failpoint %s reached: this process kills itself (%s)", name, ENV)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
