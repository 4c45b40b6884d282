"""The server's Prometheus /metrics: requests by outcome, tokens, per-request histograms,
and the engine's speculation counters and gauges as its last ``stats`` call returned them
(the engine keeps them in its own process; :func:`specdec.serving.async_engine.engine_stats`)."""

from __future__ import annotations

from ..executor.metrics import RequestMetrics

_COUNTERS = (("specdec_draft_tokens", "draft tokens proposed", "draft_tokens"),
             ("specdec_accepted_tokens", "draft tokens accepted", "accepted_tokens"),
             ("specdec_target_steps", "target forwards while decoding", "target_steps"),
             ("specdec_preemptions", "running requests preempted for KV room", "preemptions"),
             ("specdec_speculation_off_steps",
              "decode steps the adaptive planner left without drafts (they would not pay)", "speculation_off_steps"),
             ("specdec_prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache",
              "prefix_cache_queried_tokens"),
             ("specdec_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"))
_GAUGES = (("specdec_acceptance_length", "mean tokens per target step, finished requests", "acceptance_length"),
           ("specdec_queue_depth", "requests waiting", "queue_depth"),
           ("specdec_running_requests", "requests running", "running_requests"),
           ("specdec_kv_cache_usage", "share of KV blocks in use", "kv_cache_usage"),
           ("specdec_kv_cache_blocks", "KV blocks in the pool", "kv_cache_blocks"),
           ("specdec_kv_window_usage", "share of the sliding-window layers' own KV blocks in use",
            "kv_window_usage"),
           ("specdec_kv_window_blocks", "the sliding-window layers' own KV blocks (0: they use the pool)",
            "kv_window_blocks"))


class _EngineCollector:
    """The engine's counters and gauges from the stats dict the route fetched last (none
    while the engine is restarting), and how many times the engine was restarted."""

    def __init__(self):
        self.stats: dict | None = None
        self.restarts = 0

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily("specdec_engine_restarts", "engine processes started after one died",
                                  value=self.restarts)
        stats = self.stats
        if stats is None:
            return
        for name, doc, key in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats[key])
        faults = CounterMetricFamily("specdec_drafter_faults", "steps whose drafts a failing drafter cost",
                                     labels=["decoding_type"])
        faults.add_metric([stats["decoding_type"]], stats["drafter_faults"])
        yield faults
        depths = CounterMetricFamily("specdec_draft_len_steps", "decode steps by the depth of the draft verified",
                                     labels=["draft_len"])
        for depth, steps in enumerate(stats["draft_len_counts"]):
            depths.add_metric([str(depth)], steps)
        yield depths
        per_position = GaugeMetricFamily("specdec_per_position_acceptance", "acceptance rate by draft position",
                                         labels=["position"])
        for i, rate in enumerate(stats["per_position_acceptance"]):
            per_position.add_metric([str(i + 1)], rate)
        yield per_position
        for name, doc, key in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats[key])
        graphs = stats["cuda_graphs"]
        if graphs is not None:
            steps = CounterMetricFamily("specdec_cuda_graph_steps", "target forwards replayed from a CUDA graph, or "
                                        "run eagerly where no graph's bucket held the step", labels=["path"])
            steps.add_metric(["replayed"], graphs["replayed"])
            steps.add_metric(["eager"], graphs["eager"])
            yield steps
            yield GaugeMetricFamily("specdec_cuda_graphs", "CUDA graphs captured", value=graphs["graphs"])


class ServerMetrics:
    """/metrics through prometheus_client: requests by outcome, tokens, histograms of each
    request's acceptance length, time to first token and time per output token, engine
    restarts, and the engine's own counters (:class:`_EngineCollector`)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "requests by outcome", ["outcome"], registry=self.registry)
        for outcome in ("ok", "error", "aborted"):
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter("specdec_generation_tokens", "generated tokens", registry=self.registry)
        self.acceptance = Histogram("specdec_request_acceptance_length", "tokens per target step, per request",
                                    buckets=(1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0),
                                    registry=self.registry)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "time to first token", registry=self.registry)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "time per output token after the first",
                              buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0),
                              registry=self.registry)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

    def finish(self, metrics: RequestMetrics, completion_tokens: int, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if outcome != "ok":
            return
        if metrics.num_steps:
            self.acceptance.observe(metrics.acceptance_length)
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if completion_tokens > 1 and metrics.finish_time and metrics.first_token_time:
            self.tpot.observe((metrics.finish_time - metrics.first_token_time) / (completion_tokens - 1))

    def render(self, engine_stats: dict | None, restarts: int) -> bytes:
        """The exposition text, the engine's part from ``engine_stats`` (None: left out)."""
        from prometheus_client import generate_latest

        self._engine.stats, self._engine.restarts = engine_stats, restarts
        return generate_latest(self.registry)
