"""Prometheus metrics of one instance, all named ``infllm_*``, in a registry of its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

MOVE_RESULTS = ("committed", "rejected", "failed", "stale_epoch")


@dataclass
class LatencyTotals:
    """A latency's sum and count since the last ``take``: what a heartbeat reports."""

    total_us: int = 0
    count: int = 0

    def add(self, seconds: float) -> None:
        self.total_us += max(0, round(seconds * 1e6))
        self.count += 1

    def take(self) -> tuple[int, int]:
        """(microseconds summed, count) since the last take, and start again."""
        taken = (self.total_us, self.count)
        self.total_us = self.count = 0
        return taken


class CreditorCounts(Protocol):
    plans_made: int
    plan_retargets: int  # requests served by a kept plan pointed at other slices
    graph_replays: int
    graph_captures: int


class _CreditorCollector:
    """The creditor's counts as Prometheus counters: the creditor keeps them, nothing is copied."""

    def __init__(self, creditor: CreditorCounts) -> None:
        self.creditor = creditor

    def collect(self):
        c = self.creditor
        plans = CounterMetricFamily("infllm_attend_plans",
                                    "Attend plans this creditor made, by kind: new, or a kept one over moved KV",
                                    labels=["kind"])
        plans.add_metric(["new"], c.plans_made)
        plans.add_metric(["retargeted"], c.plan_retargets)
        yield plans
        yield CounterMetricFamily("infllm_attend_graph_replays", "Attend requests served from a CUDA graph",
                                  value=c.graph_replays)
        yield CounterMetricFamily("infllm_attend_graph_captures", "CUDA graphs captured for attend requests",
                                  value=c.graph_captures)


class SharedMemoryFigures(Protocol):
    def shared_memory_status(self) -> dict: ...


class _SharedMemoryCollector:
    """The transport's shared memory for peers on this host, read as ``/metrics`` is scraped."""

    def __init__(self, transport: SharedMemoryFigures) -> None:
        self.transport = transport

    def collect(self):
        status = self.transport.shared_memory_status()
        size = GaugeMetricFamily("infllm_peer_shared_memory_bytes",
                                 "This instance's shared memory for peers on its host, by state: committed, in use",
                                 labels=["state"])
        size.add_metric(["committed"], status["committed_bytes"])
        size.add_metric(["in_use"], status["in_use_bytes"])
        yield size
        yield GaugeMetricFamily("infllm_peer_shared_memory_peers",
                                "Peers this instance sends host buffers to through shared memory",
                                value=len(status["peers"]))
        rings = GaugeMetricFamily("infllm_peer_header_rings",
                                  "Connections with peers on this host whose frame headers go through rings in shared "
                                  "memory, by direction: to peers (outbound), from them (inbound)",
                                  labels=["direction"])
        rings.add_metric(["outbound"], len(status["header_ring_peers"]))
        rings.add_metric(["inbound"], status["header_ring_inbound"])
        yield rings


@dataclass
class InstanceMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests_running = Gauge("infllm_requests_running", "Requests in the running batch", registry=r)
        self.requests_waiting = Gauge("infllm_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_usage_ratio = Gauge("infllm_kv_usage_ratio", "Used KV blocks / pool blocks, 0..1", registry=r)
        self.kv_blocks_total = Gauge("infllm_kv_blocks_total", "KV blocks in this instance's pool", registry=r)
        self.kv_blocks_lent = Gauge(
            "infllm_kv_blocks_lent", "Blocks of this pool holding other instances' requests", registry=r)
        self.kv_blocks_borrowed = Gauge(
            "infllm_kv_blocks_borrowed", "Blocks of this instance's requests held on other instances", registry=r)
        self.moves = Counter("infllm_kv_moves", "KV block moves by result", ["result"], registry=r)
        for result in MOVE_RESULTS:
            self.moves.labels(result=result)
        self.held_audits = Counter(
            "infllm_held_audits", "Audits of the segments held here for another home, by result: answered, failed",
            ["result"], registry=r)
        for result in ("answered", "failed"):
            self.held_audits.labels(result=result)
        self.held_blocks_reclaimed = Counter(
            "infllm_held_blocks_reclaimed", "Blocks held for other homes freed because an audit found their home "
            "no longer counted on them (a free that never arrived)", registry=r)
        self.stale_epoch_commands = Counter(
            "infllm_stale_epoch_commands", "gManager commands refused for an epoch older than the newest seen", registry=r)
        self.remote_attention_seconds = Histogram(
            "infllm_remote_attention_seconds", "Wait for one layer's remote attention parts, seconds",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0), registry=r)
        self.attend_serve_seconds = Histogram(
            "infllm_attend_serve_seconds", "Serving one attend request for another instance (compute), seconds",
            buckets=(2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1), registry=r)
        self.segments_recomputed = Counter(
            "infllm_segments_recomputed", "KV segments of this home's requests recomputed after the instance "
            "holding them was lost", registry=r)
        self.tokens_recomputed = Counter(
            "infllm_tokens_recomputed", "Tokens whose KV was recomputed after the instance holding it was lost",
            registry=r)
        self.recompute_seconds = Histogram(
            "infllm_recompute_seconds", "From a creditor's loss to the end of a request's recompute, seconds",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0), registry=r)
        self.prompt_tokens = Counter("infllm_prompt_tokens", "Prompt tokens prefilled", registry=r)
        # Requests that asked for an APB prefill, by how they were prefilled: "apb", or "exact"
        # where it fell back (a short document, a host that failed).
        self.apb_prefills = Counter("infllm_apb_prefills", "Requests that asked for an APB prefill, by outcome",
                                    ["result"], registry=r)
        self.generated_tokens = Counter("infllm_generated_tokens", "Output tokens generated", registry=r)
        self.tokens_per_second = Gauge(
            "infllm_tokens_per_second", "Output tokens per second over the last interval", registry=r)
        self.requests_finished = Counter(
            "infllm_requests_finished", "Finished requests by reason", ["reason"], registry=r)
        # The same two latencies as sums since the last heartbeat: the gManager learns the
        # cluster's remote-attention overhead from them.
        self.remote_wait_totals = LatencyTotals()
        self.attend_serve_totals = LatencyTotals()

    def observe_remote_wait(self, seconds: float) -> None:
        """A home's wait for one layer's remote parts."""
        self.remote_attention_seconds.observe(seconds)
        self.remote_wait_totals.add(seconds)

    def observe_attend_serve(self, seconds: float) -> None:
        """A creditor's time serving one attend request."""
        self.attend_serve_seconds.observe(seconds)
        self.attend_serve_totals.add(seconds)

    def watch_creditor(self, creditor: CreditorCounts) -> None:
        """Expose the creditor's own running totals, read as ``/metrics`` is scraped."""
        self.registry.register(_CreditorCollector(creditor))

    def watch_transport(self, transport: SharedMemoryFigures) -> None:
        """Expose the transport's shared-memory figures, read as ``/metrics`` is scraped."""
        self.registry.register(_SharedMemoryCollector(transport))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
