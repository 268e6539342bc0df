"""What an instance tells the gManager each period: pool figures, batch, placement as a diff,
and its remote-attention waits and serving times since the last one.

Pure: :class:`HeartbeatState` turns the instance's current placement into the next ``Heartbeat``
and learns from the ``HeartbeatReply`` which version the leader holds. The diff is against the
last version the leader acknowledged; when the leader lacks it (a new leader, a lost heartbeat)
it asks for the full placement, and the next heartbeat carries everything (base version 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infinite_llm.transport.messages import Heartbeat, HeartbeatReply, PlacementKey, PoolFigures, RequestPlacementEntry
from infinite_llm.transport.placement import diff_placement, placement_of


@dataclass
class HeartbeatState:
    """The placement versions sent and acknowledged. The caller has at most one heartbeat in
    flight (the next is sent once the last one's reply came or its request failed), and the
    leader's reply acknowledges the version that heartbeat carried, so only the last placement
    sent is kept besides the acknowledged one: however long replies fail to come, the state
    stays two placements in size."""

    inst_id: int
    seq: int = 0
    version: int = 0  # of the placement last sent
    acked_version: int = 0  # of the placement the leader holds; 0: none
    acked: dict[PlacementKey, RequestPlacementEntry] = field(default_factory=dict)
    # version -> placement, of the last heartbeat sent (none before the first)
    _sent: dict[int, dict[PlacementKey, RequestPlacementEntry]] = field(default_factory=dict)

    def next(self, pool: PoolFigures, batch_size: int, entries: list[RequestPlacementEntry],
             remote_waits: tuple[int, int] = (0, 0), attend_serves: tuple[int, int] = (0, 0)) -> Heartbeat:
        """The heartbeat for the current ``entries`` (every request of this home, per instance),
        with the remote-attention figures since the last one: ``(microseconds summed, count)``
        of this home's waits for creditors' parts and of its serving of attend requests."""
        current = placement_of(entries)
        self.seq += 1
        self.version += 1
        if self.acked_version == 0:
            upserts, removals, base = tuple(current[k] for k in sorted(current, key=_order)), (), 0
        else:
            (upserts, removals), base = diff_placement(self.acked, current), self.acked_version
        # An older heartbeat's reply, were it to come late, is dropped: the leader then holds a
        # version this state no longer names, and answers the next diff with a full-placement
        # request, which puts the two back in step.
        self._sent = {self.version: current}
        return Heartbeat(self.inst_id, self.seq, pool, batch_size, base, self.version, upserts, removals,
                         remote_wait_us=remote_waits[0], remote_waits=remote_waits[1],
                         attend_serve_us=attend_serves[0], attend_serves=attend_serves[1])

    def on_reply(self, reply: HeartbeatReply) -> None:
        if reply.needs_full_placement:
            self.acked_version, self.acked = 0, {}
            return
        sent = self._sent.get(reply.acked_placement_version)
        if sent is not None:
            self.acked_version, self.acked = reply.acked_placement_version, sent

    def leader_changed(self) -> None:
        """A new leader holds nothing: send the full placement next."""
        self.acked_version, self.acked = 0, {}


def _order(key: PlacementKey) -> tuple[int, int]:
    return (key.req_id, key.inst_id)
