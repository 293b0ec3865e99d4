"""Prometheus metrics, in a registry of our own, served at /metrics.

Names mirror vLLM's (`vllm:e2e_request_latency_seconds`, ...) under the prefix `cdlm_serve:`,
with the same meanings and buckets, so dashboards built for vLLM need only the prefix changed.
DLM-specific series: steps per request, tokens finalized per step, step latency.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
)
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cdlm_serve.engine.heap import HeapTrimmer

PREFIX = "cdlm_serve:"
# Buckets as vLLM's (seconds), so the same dashboards read the same ranges.
# fmt: off
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
STEP_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                        1.0, 2.5, 5.0, 10.0)
STEPS_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096)
REQUEST_TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 128)
# fmt: on

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The process's own: process_resident_memory_bytes, CPU seconds, open files (Linux).
        ProcessCollector(registry=self.registry)
        model = ["model_name"]

        def histogram(
            name: str, doc: str, labels: list[str], buckets: Sequence[float]
        ) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.http_requests = counter(
            "http_requests",
            "HTTP requests answered, by method, route template and status code.",
            ["method", "route", "status"],
        )
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.", model)
        self.generation_tokens = counter(
            "generation_tokens", "Number of generation tokens processed.", model
        )
        self.request_success = counter(
            "request_success",
            "Count of successfully processed requests.",
            [*model, "finished_reason"],
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            model,
            LATENCY_BUCKETS,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            model,
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            model,
            ITL_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens",
            "Number of prefill tokens processed.",
            model,
            REQUEST_TOKENS_BUCKETS,
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Number of generation tokens processed.",
            model,
            REQUEST_TOKENS_BUCKETS,
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            model,
            LATENCY_BUCKETS,
        )
        self.compaction_seconds = histogram(
            "compaction_seconds",
            "Wall time of one KV-cache compaction.",
            ["method"],
            (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.compaction_ratio = histogram(
            "compaction_ratio",
            "Physical cache size before / after a compaction.",
            ["method"],
            (1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200),
        )
        self.dlm_steps = histogram(
            "dlm_steps_per_request",
            "Forward passes (denoising steps, the prefill included) a diffusion request took.",
            [*model, "decoding"],
            STEPS_BUCKETS,
        )
        self.dlm_tokens_per_step = histogram(
            "dlm_tokens_per_step",
            "Tokens finalized by one denoising step.",
            [*model, "decoding"],
            TOKENS_PER_STEP_BUCKETS,
        )
        self.dlm_steps_per_block = histogram(
            "dlm_steps_per_block",
            "Denoising steps (forward passes, the prefill not included) one block took.",
            [*model, "decoding"],
            TOKENS_PER_STEP_BUCKETS,
        )
        # vLLM's diffusion counters (its DiffusionGemma support), so a vLLM diffusion dashboard
        # works with the prefix changed: steps are forward passes (our prefill included), and
        # committed tokens the answer positions those steps finalized (past an end-of-text too).
        self.diffusion_denoising_steps = counter(
            "diffusion_num_denoising_steps",
            "Number of denoising steps (forward passes) run for diffusion requests.",
            model,
        )
        self.diffusion_committed_tokens = counter(
            "diffusion_num_committed_tokens",
            "Number of tokens committed (finalized) by denoising steps.",
            model,
        )
        self.dlm_e2e_latency = histogram(
            "dlm_e2e_request_latency_seconds",
            "End to end latency of diffusion requests in seconds.",
            [*model, "decoding"],
            LATENCY_BUCKETS,
        )
        self.dlm_step_latency = histogram(
            "dlm_step_latency_seconds",
            "Wall time of one batched denoising step.",
            model,
            STEP_LATENCY_BUCKETS,
        )

    def observe_request(
        self, model: str, prompt_tokens: int, generated: int, reason: str, seconds: float
    ) -> None:
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generated)
        self.request_success.labels(model, reason).inc()
        self.e2e_latency.labels(model).observe(seconds)

    def observe_ar_sequence(self, model: str, seq: Any) -> None:
        """A finished (or aborted) AR sequence (engine.decoding.ar_engine.ARSequence), as the engine
        saw it: tokens it really decoded, and its timing."""
        self.request_prompt_tokens.labels(model).observe(len(seq.prompt))
        self.request_generation_tokens.labels(model).observe(seq.generated)
        times = seq.token_times
        if seq.admitted is not None:
            self.queue_time.labels(model).observe(seq.admitted - seq.arrived)
        if times:
            self.ttft.labels(model).observe(times[0] - seq.arrived)
            itl = self.itl.labels(model)
            for a, b in itertools.pairwise(times):
                itl.observe(b - a)

    def observe_dlm_sequence(self, model: str, decoding: str, seq: Any, seconds: float) -> None:
        """A finished (or aborted) diffusion sequence (engine.decoding.dlm_sequence.DLMSequence):
        its steps, the tokens each step finalized and the steps each block took (vLLM's terms)."""
        self.dlm_steps.labels(model, decoding).observe(seq.steps)
        self.diffusion_denoising_steps.labels(model).inc(seq.steps)
        self.diffusion_committed_tokens.labels(model).inc(sum(seq.tokens_per_step))
        per_step = self.dlm_tokens_per_step.labels(model, decoding)
        for n in seq.tokens_per_step:
            per_step.observe(n)
        per_block = self.dlm_steps_per_block.labels(model, decoding)
        for n in seq.steps_per_block:
            per_block.observe(n)
        self.dlm_e2e_latency.labels(model, decoding).observe(seconds)

    def observe_dlm_step(self, model: str, seconds: float) -> None:
        self.dlm_step_latency.labels(model).observe(seconds)

    def add_gauges(self, read: Callable[[], dict[str, tuple[int, int, float, int]]]) -> None:
        """Per-model gauges read at scrape time: `read()` -> {model: (running, waiting,
        KV cache usage fraction, bytes of the engine's KV caches)}."""
        self.registry.register(_PerModel(ENGINE_GAUGES, read))

    def add_prefix_cache_counters(
        self, read: Callable[[], dict[str, tuple[int, int, int]]]
    ) -> None:
        """vLLM's prefix cache counters, read at scrape time: `read()` -> {model: (prompt
        tokens queried, tokens found cached, bytes the cache holds)}."""
        self.registry.register(_PerModel(PREFIX_CACHE_METRICS, read))

    def count_http(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(method, route, str(status)).inc()

    def add_session_gauges(
        self, read: Callable[[], tuple[int, int, int, int]], failures: Callable[[], dict[str, int]]
    ) -> None:
        """`read()` -> (sessions, bytes of caches in memory, bytes on disk, the disk quota in
        bytes or 0 for none), and `failures()` -> {where: writes of the store that failed (and
        changed nothing)}, at scrape time."""
        self.registry.register(_SessionGauges(read, failures))

    def add_heap_metrics(self, heap: HeapTrimmer) -> None:
        """What malloc holds in use, and what the trims gave back (glibc only: elsewhere
        there is nothing to read)."""
        if heap.libc is not None:
            self.registry.register(_HeapMetrics(heap))

    def render(self) -> bytes:
        return _generate_latest(self.registry)


# Per-model metrics read at scrape time: (family, name, help), in the order `read()` gives
# each model's values.
ENGINE_GAUGES = (
    (GaugeMetricFamily, "num_requests_running", "Number of requests in model execution batches."),
    (GaugeMetricFamily, "num_requests_waiting", "Number of requests waiting to be processed."),
    (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    (
        GaugeMetricFamily,
        "kv_cache_bytes",
        "Bytes the engine's batch KV caches hold (allocated, every row and slot).",
    ),
)
PREFIX_CACHE_METRICS = (
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        CounterMetricFamily,
        "prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    (
        GaugeMetricFamily,
        "prefix_cache_bytes",
        "Bytes of prompt KV the prefix cache holds (bounded by --prefix-cache-mb).",
    ),
)
Family = type[GaugeMetricFamily] | type[CounterMetricFamily]


class _PerModel(Collector):
    """Metrics labelled by model_name, read at scrape time: `read()` -> {model: one value per
    family}."""

    def __init__(
        self,
        families: tuple[tuple[Family, str, str], ...],
        read: Callable[[], Mapping[str, Sequence[float]]],
    ):
        self.families = families
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        out = [kind(PREFIX + name, doc, labels=["model_name"]) for kind, name, doc in self.families]
        for model, values in self.read().items():
            for family, value in zip(out, values, strict=True):
                family.add_metric([model], value)
        yield from out


class _SessionGauges(Collector):
    def __init__(
        self, read: Callable[[], tuple[int, int, int, int]], failures: Callable[[], dict[str, int]]
    ):
        self.read = read
        self.failures = failures

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        failed = CounterMetricFamily(
            PREFIX + "session_store_write_failures",
            "Session writes that failed and changed nothing, by where: disk (full, a quota, a "
            "file size limit: answered 507) or tier (the shared Redis tier: 503, 409).",
            labels=["where"],
        )
        for where, count in sorted(self.failures().items()):
            failed.add_metric([where], count)
        yield failed
        count, memory, disk, quota = self.read()
        yield GaugeMetricFamily(PREFIX + "sessions", "Sessions known to the server.", count)
        yield GaugeMetricFamily(
            PREFIX + "session_memory_bytes", "Bytes of session KV caches held in memory.", memory
        )
        yield GaugeMetricFamily(
            PREFIX + "session_disk_bytes", "Bytes of sessions stored on disk.", disk
        )
        yield GaugeMetricFamily(
            PREFIX + "session_disk_quota_bytes",
            "The session store's disk quota in bytes (0: no quota).",
            quota,
        )


class _HeapMetrics(Collector):
    def __init__(self, heap: HeapTrimmer):
        self.heap = heap

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(
            PREFIX + "heap_in_use_bytes",
            "Bytes the process holds through malloc (glibc's mallinfo2: arenas and mmapped "
            "blocks); RSS above it is freed memory the allocator keeps, or not malloc's.",
            self.heap.in_use_bytes(),
        )
        yield CounterMetricFamily(
            PREFIX + "heap_trims",
            "malloc_trim calls made to give freed heap memory back (--heap-trim-seconds).",
            self.heap.trims,
        )
        yield CounterMetricFamily(
            PREFIX + "heap_trim_released_bytes",
            "Resident bytes the malloc_trim calls gave back to the OS, summed.",
            self.heap.released_bytes,
        )
