"""Prometheus metrics of one server, under vLLM's names, in a registry of its own.

    metrics = ServerMetrics(async_llm, model_name)    one CollectorRegistry per app (tests build many)
    metrics.observe(output)                           each finished RequestOutput: token counters,
                                                      TTFT / TPOT / end-to-end histograms
    metrics.render() -> (bytes, content type)         GET /metrics

Gauges and engine counters (running, waiting, KV cache usage, preemptions) are read at scrape time
from `AsyncLLM.stats()`, the snapshot the engine thread takes after each step.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.core.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0)  # fmt: skip


class _EngineCollector:
    """Scrape-time gauges and counters from the engine's last stats snapshot."""

    def __init__(self, async_llm, model_name: str):
        self.async_llm, self.labels = async_llm, {"model_name": model_name}

    def collect(self):
        s = self.async_llm.stats()
        names = list(self.labels)
        values = list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in a slot.", s["num_running"])
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests waiting for a slot.",
            self.async_llm.num_waiting,
        )
        used = s.get("num_used_pages", 0)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV cache pages in use (1 = full).",
            used / s["num_kv_pages"] if s["num_kv_pages"] else 0.0,
        )
        yield counter(
            "vllm:num_preemptions", "Preemptions (recompute) so far.", s["num_preemptions"]
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefill tokens taken from the prefix cache.",
            s["num_cached_prefill_tokens"],
        )
        yield counter("jaxserve:engine_steps", "Engine steps with device work.", s["num_steps"])
        for name, doc in (
            ("num_drafts", "Speculative decode rows verified (one draft each)."),
            ("num_draft_tokens", "Draft tokens proposed."),
            ("num_accepted_tokens", "Draft tokens accepted."),
        ):
            yield counter(f"vllm:spec_decode_{name}", doc, s["num_spec_" + name[4:]])


class ServerMetrics:
    def __init__(self, async_llm, model_name: str):
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Generated tokens of finished requests.",
            labels,
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (finished requests).",
            labels,
            registry=registry,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token after the first.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineCollector(async_llm, model_name))

    def observe(self, out: RequestOutput) -> None:
        """Counts one finished output (an error output counts nothing)."""
        if out.error is not None:
            return
        lab = self._labels
        self.prompt_tokens.labels(**lab).inc(len(out.prompt_token_ids))
        self.prefix_cache_queries.labels(**lab).inc(len(out.prompt_token_ids) * len(out.outputs))
        self.generation_tokens.labels(**lab).inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.request_success.labels(**lab, finished_reason=c.finish_reason or "abort").inc()
        m = out.metrics
        if m.ttft is not None:
            self.ttft.labels(**lab).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(**lab).observe(m.tpot)
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        self.e2e.labels(**lab).observe(max(end - m.arrival_time, 0.0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
