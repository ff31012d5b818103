"""`GET /metrics` of the embedded engine, in Prometheus text format, read at scrape time.

| metric | type |
|---|---|
| `reins_engine_prompts_total` | counter: prompts prefilled |
| `reins_engine_prompt_tokens_total` | counter: their tokens |
| `reins_engine_prefix_cache_hits_total` | counter: prompts that reused a cached prefix |
| `reins_engine_prefix_cache_reused_tokens_total` | counter: prompt tokens taken from the cache |
| `reins_engine_prefilled_tokens_total` | counter: prompt tokens computed (prompt - reused) |
| `reins_engine_prefix_cache_bytes`, `..._capacity_bytes`, `..._entries` | gauges |
| `reins_engine_prefix_cache_evictions_total` | counter: entries dropped for room |
| `reins_engine_prefix_cache_invalidations_total` | counter: entries dropped for new weights |
| `reins_engine_running`, `reins_engine_waiting` | gauges: sequences |
| `reins_engine_decode_steps_total` | counter |
| `reins_engine_weight_version` | gauge |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from reins.engine.embedded import EmbeddedEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        stats = engine.prefix_cache_stats()
        running, waiting = engine.scheduler.load()
        counters = [
            ("reins_engine_prompts", "Prompts prefilled", stats.queries),
            ("reins_engine_prompt_tokens", "Tokens of the prompts prefilled", stats.prompt_tokens),
            (
                "reins_engine_prefix_cache_hits",
                "Prompts that reused a prefix from the prefix cache",
                stats.hits,
            ),
            (
                "reins_engine_prefix_cache_reused_tokens",
                "Prompt tokens whose KV came from the prefix cache",
                stats.reused_tokens,
            ),
            (
                "reins_engine_prefilled_tokens",
                "Prompt tokens computed by a prefill (prompt tokens - reused tokens)",
                stats.prompt_tokens - stats.reused_tokens,
            ),
            (
                "reins_engine_prefix_cache_evictions",
                "Prefix cache entries dropped to stay under the capacity",
                stats.evicted,
            ),
            (
                "reins_engine_prefix_cache_invalidations",
                "Prefix cache entries dropped because the weights changed",
                stats.invalidated,
            ),
            ("reins_engine_decode_steps", "Decode steps run", engine.scheduler.steps),
        ]
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)
        gauges = [
            (
                "reins_engine_prefix_cache_bytes",
                "Bytes of KV held by the prefix cache",
                stats.bytes,
            ),
            (
                "reins_engine_prefix_cache_capacity_bytes",
                "The prefix cache's capacity in bytes (0: off)",
                stats.capacity_bytes,
            ),
            ("reins_engine_prefix_cache_entries", "Entries in the prefix cache", stats.entries),
            ("reins_engine_running", "Sequences in the decode batch", running),
            ("reins_engine_waiting", "Sequences waiting to join the batch", waiting),
            ("reins_engine_weight_version", "The weight version served", engine.weight_version),
        ]
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)


def engine_metrics(engine: EmbeddedEngine) -> CollectorRegistry:
    """A registry of its own for `engine` (several engines may share a process)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return bytes(generate_latest(registry))
