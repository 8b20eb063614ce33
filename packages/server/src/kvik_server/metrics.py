"""Prometheus metrics with vLLM's names under the ``kvik:`` prefix, fed by AsyncLLM's stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvik.engine.async_llm import IterationStats
from kvik.scheduler.output import SchedulerStats
from kvik.spec_decode.metrics import METRIC_DOCS, NUM_ACCEPTED_TOKENS_PER_POS, SpecDecodingStats


def _latency_buckets() -> tuple[float, ...]:
    """Upper bounds in seconds, spaced so that a median or p99 read from the histogram (linear
    within a bucket) is within 10% of the true one from 1 ms to 10 s: 1 ms steps to 20 ms, then
    steps of about a tenth of the bound; coarser beyond 10 s."""
    ms = list(range(1, 21))  # 1..20 ms
    ms += [22.5, 25, 27.5, 30, 32.5, 35, 37.5, 40, 42.5, 45, 47.5, 50]
    ms += list(range(55, 101, 5)) + list(range(110, 251, 10)) + list(range(275, 501, 25))
    ms += list(range(550, 1001, 50)) + list(range(1100, 2501, 100)) + list(range(2750, 5001, 250))
    ms += list(range(5500, 10001, 500))
    return tuple(m / 1000 for m in ms) + (15.0, 20.0, 30.0, 40.0, 60.0, 80.0, 160.0, 640.0)


_LATENCY_BUCKETS = _latency_buckets()


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvik:{name}", doc, **label).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvik:{name}", doc, **label).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kvik:{name}", doc, buckets=_LATENCY_BUCKETS, **label).labels(
                model_name
            )

        self.model_name = model_name
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.success = Counter(
            "kvik:request_success",
            "Finished requests, by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.")
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "Mean time per output token of a request."
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end.")
        self.queue_time = histogram("request_queue_time_seconds", "Time spent waiting.")
        self._last = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        # Speculative decoding's counters (vLLM's names), made when the engine first reports
        # speculation: an engine without it exposes none.
        self._spec_counters: dict[str, Counter] = {}
        self._last_spec: SpecDecodingStats | None = None

    def record(self, stats: SchedulerStats, iteration: IterationStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        # The scheduler's counts are cumulative; the counters take their increments.
        self.preemptions.inc(max(0, stats.num_preemptions - self._last.num_preemptions))
        self.prefix_queries.inc(
            max(0, stats.prefix_cache_queries - self._last.prefix_cache_queries)
        )
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - self._last.prefix_cache_hits))
        self._last = stats
        if stats.spec_decoding is not None:
            self._record_spec_decoding(stats.spec_decoding)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration.finished:
            self.success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time.observe(finished.queue_time)
            if finished.mean_time_per_output_token is not None:
                self.tpot.observe(finished.mean_time_per_output_token)

    def _record_spec_decoding(self, stats: SpecDecodingStats) -> None:
        """The engine's counts are cumulative: the counters take what grew since the last call."""
        if not self._spec_counters:
            for name, doc in METRIC_DOCS.items():
                labels = ["model_name"]
                if name == NUM_ACCEPTED_TOKENS_PER_POS:
                    labels.append("position")
                self._spec_counters[name] = Counter(
                    name, doc, labelnames=labels, registry=self.registry
                )
        for name, labels, grown in stats.minus(self._last_spec).prometheus_increments():
            counter = self._spec_counters[name].labels(model_name=self.model_name, **labels)
            if grown > 0:
                counter.inc(grown)
        self._last_spec = stats
