"""Placement diffs carried by heartbeats: compute on the instance, apply on the gManager.

No I/O here. The placement of an instance is a map (req_id, inst_id) -> entry. Each heartbeat
carries the changes since the version the gManager last acknowledged, or the full map when the
gManager asked for it (``placement_base_version == 0``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from infinite_llm.transport.messages import Heartbeat, PlacementKey, RequestPlacementEntry

Placement = Mapping[PlacementKey, RequestPlacementEntry]


def key_of(entry: RequestPlacementEntry) -> PlacementKey:
    return PlacementKey(req_id=entry.req_id, inst_id=entry.inst_id)


def placement_of(entries: list[RequestPlacementEntry]) -> dict[PlacementKey, RequestPlacementEntry]:
    return {key_of(e): e for e in entries}


def diff_placement(
    old: Placement, new: Placement
) -> tuple[tuple[RequestPlacementEntry, ...], tuple[PlacementKey, ...]]:
    """(upserts, removals) that turn ``old`` into ``new``, in key order (deterministic)."""
    upserts = tuple(new[k] for k in sorted(new, key=_order) if old.get(k) != new[k])
    removals = tuple(k for k in sorted(old, key=_order) if k not in new)
    return upserts, removals


class PlacementGap(Exception):
    """A heartbeat's diff does not apply to the version held: ask for the full placement."""


@dataclass(frozen=True)
class VersionedPlacement:
    version: int  # 0: nothing known yet
    entries: Mapping[PlacementKey, RequestPlacementEntry]


def apply_heartbeat(held: VersionedPlacement, heartbeat: Heartbeat) -> VersionedPlacement:
    """The placement after ``heartbeat``. Raises PlacementGap when its base is not ``held``."""
    if heartbeat.placement_base_version == 0:
        entries: dict[PlacementKey, RequestPlacementEntry] = {}
    elif heartbeat.placement_base_version == held.version:
        entries = dict(held.entries)
    else:
        raise PlacementGap(
            f"diff from version {heartbeat.placement_base_version}, held {held.version}"
        )
    for key in heartbeat.placement_removals:
        entries.pop(key, None)
    for entry in heartbeat.placement_upserts:
        entries[key_of(entry)] = entry
    return VersionedPlacement(version=heartbeat.placement_version, entries=entries)


def _order(key: PlacementKey) -> tuple[int, int]:
    return (key.req_id, key.inst_id)
