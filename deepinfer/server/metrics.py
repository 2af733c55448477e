"""Prometheus metrics (`deepinfer_` prefix) on a registry of their own, so several apps in one process
(tests) never collide on the global registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.waiting = Gauge("deepinfer_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("deepinfer_num_requests_running", "Requests being decoded", registry=r)
        self.kv_usage = Gauge("deepinfer_kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds", "Mean inter-token time per request",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens", registry=r)
        self.requests_received = Counter("deepinfer_requests_received", "Engine requests queued", registry=r)
        self.requests_finished = Counter("deepinfer_requests_finished", "Engine requests finished", ["reason"],
                                         registry=r)
        self.http_errors = Counter("deepinfer_http_errors", "Requests rejected, by status", ["status"], registry=r)
        # speculative decoding, per draft position (1 = the first draft after the last real token)
        self.spec_drafts = Counter("deepinfer_spec_decode_num_draft_tokens", "Draft tokens verified",
                                   ["position"], registry=r)
        self.spec_accepted = Counter("deepinfer_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     ["position"], registry=r)
        self.spec_acceptance = Gauge("deepinfer_spec_decode_acceptance_rate", "Accepted / verified drafts so far",
                                     ["position"], registry=r)
        self._spec_seen: tuple[list[int], list[int]] = ([], [])

    def set_gauges(self, waiting: int, running: int, kv_usage: float) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)

    def set_spec(self, stats) -> None:
        """Catch the counters up with the engine's cumulative `spec.AcceptanceStats` (None: no drafting)."""
        if stats is None:
            return
        seen_p, seen_a = self._spec_seen
        for j, (p, a) in enumerate(zip(stats.proposed, stats.accepted)):
            pos = str(j + 1)
            self.spec_drafts.labels(pos).inc(p - (seen_p[j] if j < len(seen_p) else 0))
            self.spec_accepted.labels(pos).inc(a - (seen_a[j] if j < len(seen_a) else 0))
            self.spec_acceptance.labels(pos).set(a / p if p else 0.0)
        self._spec_seen = (list(stats.proposed), list(stats.accepted))

    def render(self) -> bytes:
        return generate_latest(self.registry)
