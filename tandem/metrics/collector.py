"""Prometheus metrics under SGLang's names and labels (--enable-metrics, GET /metrics).

The HTTP server runs prometheus_client's multiprocess mode: `enable_multiprocess_metrics` points
PROMETHEUS_MULTIPROC_DIR at a private directory inside the server's ipc directory (so it
goes with it at shutdown) before any TokenizerManager exists, and every tokenizer worker
(--tokenizer-worker-num N) writes its own files there; a scrape of any worker adds them
up. prometheus_client picks its value class when first imported, so it is imported only
after that variable is set (here, inside the functions). Without it (an in-process
Engine) each collector keeps its metrics in a registry of its own.

Request metrics are observed by the TokenizerManager as outputs arrive. The scheduler's
gauges are read at scrape time from its live counts (`ServerStateOutput`) and set with
multiprocess_mode "mostrecent" (the last scrape wins, whichever worker made it).
sglang:cache_hit_rate is the share of prompt tokens served from the prefix cache over
all finished requests (cached_tokens_total / prompt_tokens_total).
"""

from __future__ import annotations

import os
from typing import Any

from tandem.messages import ServerStateOutput

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# SGLang's default buckets (sglang/srt/observability/metrics_collector.py).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1.000,
    2.000,
    4.000,
    6.000,
    8.000,
)
TOKENS_BUCKETS = (
    100,
    300,
    500,
    700,
    1000,
    1500,
    2000,
    3000,
    4000,
    5000,
    6000,
    7000,
    8000,
    9000,
    10000,
    12500,
    15000,
    17500,
    20000,
    22500,
    25000,
    27500,
    30000,
    35000,
    40000,
    60000,
    80000,
    100000,
    200000,
    300000,
    400000,
    600000,
    800000,
    1000000,
    1100000,
)


def enable_multiprocess_metrics(ipc_dir: str) -> str:
    """Create `{ipc_dir}/prometheus` and point PROMETHEUS_MULTIPROC_DIR at it (call in the
    main process before prometheus_client is imported and before workers start)."""
    path = os.path.join(ipc_dir, "prometheus")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ[MULTIPROC_DIR_ENV] = path
    return path


def _streaming(stream: bool) -> str:
    return "true" if stream else "false"


class TokenizerMetricsCollector:
    """The metrics of one server: SGLang's tokenizer-side request metrics, its scheduler
    gauges (`set_server_state`), and `render` for GET /metrics."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine_type": "unified"}
        names = list(self.labels)
        stream_names = [*names, "is_streaming"]
        self.prompt_tokens_total = Counter(
            "sglang:prompt_tokens_total", "Number of prefill tokens processed.", stream_names, registry=self.registry
        )
        self.generation_tokens_total = Counter(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            stream_names,
            registry=self.registry,
        )
        self.cached_tokens_total = Counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*names, "cache_source"],
            registry=self.registry,
        )
        self.num_requests_total = Counter(
            "sglang:num_requests_total", "Number of requests processed.", stream_names, registry=self.registry
        )
        self.num_aborted_requests_total = Counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted.", names, registry=self.registry
        )
        # Not in SGLang: finished requests by finish_reason type (stop, length, abort, ...).
        self.finished_requests_total = Counter(
            "tandem:finished_requests_total",
            "Number of finished requests by finish reason.",
            [*names, "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens_histogram = Histogram(
            "sglang:prompt_tokens_histogram",
            "Histogram of prompt token length.",
            names,
            buckets=TOKENS_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens_histogram = Histogram(
            "sglang:generation_tokens_histogram",
            "Histogram of generation token length.",
            names,
            buckets=TOKENS_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stream_names,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            names,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            stream_names,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, multiprocess_mode="mostrecent", registry=self.registry).labels(**self.labels)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.kv_available_tokens = gauge(
            "sglang:kv_available_tokens", "Number of free token slots in the KV cache pool."
        )
        self.kv_evictable_tokens = gauge(
            "sglang:kv_evictable_tokens", "Number of evictable (radix-cached) token slots in the KV cache pool."
        )
        self.kv_used_tokens = gauge(
            "sglang:kv_used_tokens", "Number of actively used token slots in the KV cache pool."
        )
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.spec_accept_length = gauge(
            "sglang:spec_accept_length", "The average acceptance length of speculative decoding."
        )
        self.spec_accept_rate = gauge("sglang:spec_accept_rate", "The acceptance rate of speculative decoding drafts.")

    # ---- requests (TokenizerManager) -----------------------------------------------
    def observe_time_to_first_token(self, seconds: float, stream: bool) -> None:
        self.time_to_first_token.labels(**self.labels, is_streaming=_streaming(stream)).observe(seconds)

    def observe_inter_token_latency(self, interval: float, num_new_tokens: int) -> None:
        """`num_new_tokens` tokens arrived `interval` seconds after the previous ones: one
        observation of interval / n per token, as SGLang counts."""
        hist = self.inter_token_latency.labels(**self.labels)
        for _ in range(num_new_tokens):
            hist.observe(interval / num_new_tokens)

    def observe_finished_request(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        cached_tokens: int,
        e2e_latency: float,
        stream: bool,
        finish_reason: str,
    ) -> None:
        stream_labels = {**self.labels, "is_streaming": _streaming(stream)}
        self.prompt_tokens_total.labels(**stream_labels).inc(prompt_tokens)
        self.generation_tokens_total.labels(**stream_labels).inc(generation_tokens)
        if cached_tokens > 0:
            self.cached_tokens_total.labels(**self.labels, cache_source="total").inc(cached_tokens)
        self.num_requests_total.labels(**stream_labels).inc()
        self.finished_requests_total.labels(**self.labels, finish_reason=finish_reason).inc()
        if finish_reason == "abort":
            self.num_aborted_requests_total.labels(**self.labels).inc()
        self.e2e_request_latency.labels(**stream_labels).observe(e2e_latency)
        self.prompt_tokens_histogram.labels(**self.labels).observe(prompt_tokens)
        self.generation_tokens_histogram.labels(**self.labels).observe(generation_tokens)

    # ---- scrape --------------------------------------------------------------------
    def set_server_state(self, state: ServerStateOutput) -> None:
        """The scheduler's gauges from its live counts."""
        used = state.max_total_num_tokens - state.free_kv_slots - state.evictable_cached_slots
        self.num_running_reqs.set(state.num_running_reqs)
        self.num_queue_reqs.set(state.num_waiting_reqs)
        self.num_used_tokens.set(used)
        self.kv_used_tokens.set(used)
        self.kv_available_tokens.set(state.free_kv_slots)
        self.kv_evictable_tokens.set(state.evictable_cached_slots)
        self.token_usage.set(used / max(state.max_total_num_tokens, 1))
        if state.spec_verify_steps:  # --speculative-algorithm: output tokens per decode step, drafts accepted
            self.spec_accept_length.set(
                (state.spec_verify_steps + state.spec_accepted_tokens) / state.spec_verify_steps
            )
            self.spec_accept_rate.set(state.spec_accepted_tokens / max(state.spec_draft_tokens, 1))

    def render(self) -> bytes:
        """The metrics (in multiprocess mode every process's, added up) in the Prometheus
        text format."""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        registry = self.registry
        if os.environ.get(MULTIPROC_DIR_ENV):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        totals = {"sglang:prompt_tokens": 0.0, "sglang:cached_tokens": 0.0}
        for family in registry.collect():
            if family.name in totals:
                totals[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
        prompt = totals["sglang:prompt_tokens"]
        self.cache_hit_rate.set(totals["sglang:cached_tokens"] / prompt if prompt else 0.0)
        return generate_latest(registry)
