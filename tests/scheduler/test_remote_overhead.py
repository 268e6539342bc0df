"""The remote-attention overhead learnt from heartbeats: the window, and the gManager's model."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from infinite_llm.daemon.heartbeat import HeartbeatState
from infinite_llm.daemon.metrics import InstanceMetrics
from infinite_llm.scheduler.election import LeaderInfo, LocalElection
from infinite_llm.scheduler.gmanager import GManager, GManagerConfig
from infinite_llm.scheduler.perf_model import load_model
from infinite_llm.scheduler.remote_overhead import RemoteOverheadWindow
from infinite_llm.transport.messages import PoolFigures
from gmanager_testlib import PERF_MODEL, heartbeat


def test_the_overhead_is_the_mean_wait_less_the_mean_serving_time() -> None:
    window = RemoteOverheadWindow(window_s=10.0, min_waits=4)
    window.add(0.0, wait_us=6000, waits=3, serve_us=0, serves=0)  # a home: 2 ms a wait
    assert window.estimate_s(0.0) is None  # 3 waits: too few
    window.add(1.0, wait_us=2000, waits=1, serve_us=0, serves=0)
    assert window.estimate_s(1.0) == pytest.approx(2e-3)  # no serving reported: the wait whole
    window.add(1.0, wait_us=0, waits=0, serve_us=1500, serves=3)  # its creditor: 0.5 ms a request
    assert window.estimate_s(1.0) == pytest.approx(1.5e-3)


def test_old_heartbeats_leave_the_window_and_figures_are_checked() -> None:
    window = RemoteOverheadWindow(window_s=10.0, min_waits=1)
    window.add(0.0, wait_us=9000, waits=1, serve_us=0, serves=0)
    window.add(5.0, wait_us=1000, waits=1, serve_us=0, serves=0)
    assert window.estimate_s(5.0) == pytest.approx(5e-3)
    assert window.estimate_s(12.0) == pytest.approx(1e-3)  # the first left at t > 10
    assert window.estimate_s(30.0) == pytest.approx(1e-3)  # nothing in the window: the last estimate
    assert RemoteOverheadWindow(window_s=10.0).estimate_s(0.0) is None  # never measured
    window.add(40.0, wait_us=100, waits=1, serve_us=900, serves=1)
    assert window.estimate_s(40.0) == 0.0  # never below zero
    with pytest.raises(ValueError):
        window.add(41.0, wait_us=-1, waits=1, serve_us=0, serves=0)
    with pytest.raises(ValueError):
        RemoteOverheadWindow(window_s=0.0)


def test_a_daemon_reports_its_waits_since_the_last_heartbeat() -> None:
    metrics = InstanceMetrics()
    state = HeartbeatState(inst_id=1)
    metrics.observe_remote_wait(0.002)
    metrics.observe_remote_wait(0.001)
    metrics.observe_attend_serve(0.0005)
    beat = state.next(PoolFigures(64, 10, 0, 0), 1, [], remote_waits=metrics.remote_wait_totals.take(),
                      attend_serves=metrics.attend_serve_totals.take())
    assert (beat.remote_wait_us, beat.remote_waits, beat.attend_serve_us, beat.attend_serves) == (3000, 2, 500, 1)
    again = state.next(PoolFigures(64, 10, 0, 0), 1, [], remote_waits=metrics.remote_wait_totals.take(),
                       attend_serves=metrics.attend_serve_totals.take())
    assert (again.remote_wait_us, again.remote_waits, again.attend_serve_us, again.attend_serves) == (0, 0, 0, 0)


class HeldElection(LocalElection):
    def is_leader(self) -> bool:
        return True


def test_the_gmanager_plans_with_the_overhead_its_instances_report(tmp_path) -> None:
    now = [0.0]
    calibrated = load_model(PERF_MODEL)
    config = GManagerConfig(state_dir=tmp_path, perf_model_path=PERF_MODEL, remote_overhead_window_s=30.0)
    gm = GManager(config, calibrated, HeldElection(tmp_path), clock=lambda: now[0])
    gm.leadership = LeaderInfo(epoch=1, pid=os.getpid(), peer_host="127.0.0.1", peer_port=1, http_port=0,
                               socket_path="")
    assert gm.model_now(0.0) is calibrated  # nothing reported yet

    def beat(inst_id: int, seq: int, **figures) -> None:
        message = dataclasses.replace(heartbeat(inst_id, seq, 64, 10, 1, 0, seq), **figures)
        asyncio.run(gm.handle(message))

    beat(1, 1, remote_wait_us=200 * 2500, remote_waits=200)  # the home: 2.5 ms a layer
    beat(2, 1, attend_serve_us=200 * 500, attend_serves=200)  # its creditor: 0.5 ms a request
    model = gm.model_now(0.0)
    assert model.remote_overhead_s == pytest.approx(2e-3)
    assert dataclasses.replace(model, remote_overhead_s=calibrated.remote_overhead_s) == calibrated
    assert gm.status()["remote_overhead_s"]["measured"] == pytest.approx(2e-3)
    now[0] = 100.0  # the figures aged out (no request split since): the measured figure holds
    assert gm.model_now(100.0).remote_overhead_s == pytest.approx(2e-3)

    off = GManager(dataclasses.replace(config, remote_overhead_window_s=0.0), calibrated, HeldElection(tmp_path))
    assert off.remote_overhead is None and off.model_now(0.0) is calibrated
    with pytest.raises(ValueError, match="remote_overhead_window_s"):
        GManagerConfig(state_dir=tmp_path, perf_model_path=PERF_MODEL, remote_overhead_window_s=-1.0)
