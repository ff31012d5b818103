"""`GET /metrics`: the gateway in Prometheus text format.

Hot paths pay only counter increments: the proxy calls `GatewayMetrics.observe_call` once per
recorded call (a counter, a histogram bucket, two token counters). The admission gate's state
and the rollout counts are read when Prometheus scrapes, not kept up to date.

| metric | type | labels |
|---|---|---|
| `reins_proxy_calls_total` | counter | kind, mode, status |
| `reins_proxy_call_latency_seconds` | histogram | kind, mode |
| `reins_proxy_prompt_tokens_total`, `reins_proxy_response_tokens_total` | counter | mode |
| `reins_proxy_in_flight` | gauge | |
| `reins_admission_held` | gauge | |
| `reins_admission_paused` | gauge (0/1) | |
| `reins_admission_pauses_total` | counter | |
| `reins_rollouts` | gauge | state, mode |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reins.schemas import ModelRequest

if TYPE_CHECKING:  # the gateway imports this module: no import back at run time
    from reins.gateway.admission import AdmissionGate
    from reins.gateway.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))
STATES = ("queuing", "running", "succeeded", "failed")
MODES = ("train", "val")


class _GateCollector(Collector):
    """Reads the admission gate at scrape time."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate

    def collect(self) -> Iterator[Metric]:
        status = self.gate.status()
        yield GaugeMetricFamily(
            "reins_proxy_in_flight",
            "Proxied LLM calls admitted and not finished (a stream counts until its last chunk)",
            value=status.in_flight,
        )
        yield GaugeMetricFamily(
            "reins_admission_held",
            "LLM calls waiting at the admission gate for a weight update to end",
            value=status.held,
        )
        yield GaugeMetricFamily(
            "reins_admission_paused",
            "1 while the admission gate is paused for a weight update",
            value=int(status.paused),
        )
        yield CounterMetricFamily(
            "reins_admission_pauses",
            "Pauses of the admission gate since the gateway started",
            value=status.pauses,
        )


class GatewayMetrics:
    """One gateway's metrics, in a registry of its own (several gateways may share a process)."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "reins_proxy_calls",
            "LLM calls through the proxy, by kind (chat, completions, responses, messages), mode "
            "and HTTP status",
            ["kind", "mode", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "reins_proxy_call_latency_seconds",
            "Seconds from forwarding a call to the engine to its last byte",
            ["kind", "mode"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "reins_proxy_prompt_tokens",
            "Prompt tokens the engine consumed, as recorded",
            ["mode"],
            registry=self.registry,
        )
        self.response_tokens = Counter(
            "reins_proxy_response_tokens",
            "Response tokens the engine sampled, as recorded",
            ["mode"],
            registry=self.registry,
        )
        self.rollouts = Gauge(
            "reins_rollouts",
            "Rollouts by state and mode",
            ["state", "mode"],
            registry=self.registry,
        )
        self.registry.register(_GateCollector(gate))
        self._by_labels: dict[tuple[str, str, int], tuple[Any, Any, Any, Any]] = {}

    def observe_call(self, record: ModelRequest) -> None:
        """One recorded call (one per choice when n > 1: only the first choice counts a call)."""
        mode = str(getattr(record, "mode", "") or "")
        kind = str(getattr(record, "kind", "") or "")
        calls, latency, prompt_tokens, response_tokens = self._children(kind, mode, record.status)
        if getattr(record, "choice_index", 0) == 0:
            calls.inc()
            if record.latency_s is not None:
                latency.observe(record.latency_s)
            prompt_tokens.inc(len(record.prompt_token_ids))
        response_tokens.inc(len(record.response_token_ids))

    def _children(self, kind: str, mode: str, status: int) -> tuple[Any, Any, Any, Any]:
        """The labelled series of a call, looked up once per label set (`labels()` checks and
        locks on every call: ~40 us of the proxy's ~2 ms per call on 2 cores)."""
        key = (kind, mode, status)
        children = self._by_labels.get(key)
        if children is None:
            children = (
                self.calls.labels(kind, mode, str(status)),
                self.latency.labels(kind, mode),
                self.prompt_tokens.labels(mode),
                self.response_tokens.labels(mode),
            )
            self._by_labels[key] = children
        return children

    async def scrape(self, store: Store) -> bytes:
        """The text Prometheus reads; counts rollouts first."""
        counts = await store.count_rollouts()
        for state in STATES:
            for mode in MODES:
                self.rollouts.labels(state, mode).set(counts.get((state, mode), 0))
        return generate_latest(self.registry)
