"""Prometheus metrics with vLLM's names under a `nanoserve:` prefix (GET /metrics).

Two sources. The engine's state (queues, KV blocks) and its counters (`scheduler.stats`) are read
when /metrics is scraped, by a collector: nothing is counted twice, and the token counters show the
engine's own work (an aborted request stops adding to them). Per-request latencies are measured
here, in the server, around each request's output stream, from the moment its HTTP request arrived.
"""
from collections.abc import AsyncIterator
from time import perf_counter

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nanoserve.outputs import RequestOutput

# vLLM's buckets (seconds), cut to what a CPU engine can reach
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)


class EngineCollector(Collector):
    """Reads the scheduler's queues, the KV pool and the scheduler's counters at scrape time."""

    def __init__(self, core, model_name: str):
        self.core, self.labels = core, [model_name]  # core: has .scheduler and .block_manager

    def collect(self):
        scheduler, blocks = self.core.scheduler, self.core.block_manager
        stats = scheduler.stats
        gauges = {
            "num_requests_running": ("Requests in the running batch", len(scheduler.running)),
            "num_requests_waiting": ("Requests waiting to be scheduled", len(scheduler.waiting)),
            "num_requests_swapped": ("Requests whose KV is swapped out to host memory",
                                     len(scheduler.queues().get("swapped", ()))),  # (swap's queue)
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full)",
                                    1 - blocks.num_free_blocks / blocks.num_blocks),
        }
        counters = {
            "prompt_tokens": ("Prompt tokens admitted by prefills (a preempted request's count "
                              "again)", stats.num_prompt_tokens),
            "generation_tokens": ("Tokens generated", stats.num_generated_tokens),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                     stats.num_prompt_tokens),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache",
                                  stats.num_cached_tokens),
            "num_preemptions": ("Requests preempted (recomputed or swapped out)",
                                stats.num_preemptions),
            # the prefix cache's host tier (kv_offloading_size; vLLM's external_prefix_cache_* for a
            # cache outside the device pool): 0 without it
            "external_prefix_cache_hits": ("Prompt tokens found in the host tier and copied back",
                                           stats.num_host_cached_tokens),
            "kv_offload_blocks_offloaded": ("Evicted cached KV blocks copied to the host tier",
                                            stats.num_offloaded_blocks),
            "kv_offload_blocks_loaded": ("KV blocks copied back from the host tier",
                                         stats.num_loaded_blocks),
            # speculative decoding (vLLM's spec_decode_* names): 0 without a speculative_config
            "spec_decode_num_drafts": ("Verifications of a request's draft tokens",
                                       stats.spec_decoding.num_drafts),
            "spec_decode_num_draft_tokens": ("Draft tokens proposed",
                                             stats.spec_decoding.num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens accepted",
                                                stats.spec_decoding.num_accepted_tokens),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"nanoserve:{name}", doc, labels=["model_name"])
            family.add_metric(self.labels, value)
            yield family
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(f"nanoserve:{name}", doc, labels=["model_name"])
            family.add_metric(self.labels, value)
            yield family
        name = "spec_decode_num_accepted_tokens_per_pos"  # one series per draft position
        per_pos = CounterMetricFamily(f"nanoserve:{name}", "Draft tokens accepted at each position",
                                      labels=["model_name", "position"])
        for i, value in enumerate(stats.spec_decoding.num_accepted_tokens_per_pos):
            per_pos.add_metric([*self.labels, str(i)], value)
        yield per_pos


class Metrics:
    """One registry per server (so that two servers in one process, as in tests, do not collide)."""

    def __init__(self, core, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(core, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"nanoserve:{name}", doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first", TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Request latency, arrival to last token", E2E_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, stream: AsyncIterator[RequestOutput],
                      arrival: float) -> AsyncIterator[RequestOutput]:
        """Pass a request's (delta) outputs through, timing its first and last token. With n > 1 the
        sequences decode side by side: TPOT counts the tokens of the longest. A sequence that came
        whole, in one output (a beam search's), has no time per token."""
        first_token_time, num_tokens, num_outputs = None, {}, {}
        async for out in stream:
            c = out.outputs[0]
            if first_token_time is None and c.token_ids:
                first_token_time = perf_counter()
                self.ttft.observe(first_token_time - arrival)
            num_tokens[c.index] = num_tokens.get(c.index, 0) + len(c.token_ids)
            num_outputs[c.index] = num_outputs.get(c.index, 0) + bool(c.token_ids)
            if out.finished:
                now = perf_counter()
                self.e2e.observe(now - arrival)
                longest = max(num_tokens.values())
                if longest > 1 and max(num_outputs.values()) > 1:
                    self.tpot.observe((now - first_token_time) / (longest - 1))
            yield out
