"""``/metrics``: Prometheus text (prometheus-client), llama-server's
``llamacpp:*`` counters and gauges plus FLE's own: the prompt cache, MTP
drafts and, where the model runs one, the expert cache's hit rate and
misses per token."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def expert_cache_stats(model) -> tuple[int, int, int] | None:
    """(requests, hits, steps) of the model's expert cache, or None without one."""
    cache = getattr(model, "cache", None)
    st = getattr(cache, "stats", None)
    if st is not None and hasattr(st, "hits"):
        return int(st.requests), int(st.hits), int(st.steps)
    req = hit = steps = 0
    found = False
    for moe in getattr(model, "moe_layers", lambda: [])() if callable(getattr(model, "moe_layers", None)) else []:
        s = getattr(getattr(moe, "store", None), "stats", None)
        if s is not None:
            found = True
            req, hit, steps = req + s.requests, hit + s.hits, max(steps, s.steps)
    return (req, hit, steps) if found else None


class _Collector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        c = CounterMetricFamily
        g = GaugeMetricFamily
        yield c("llamacpp:prompt_tokens", "Number of prompt tokens processed.", e.n_prompt_total)
        yield c("llamacpp:prompt_seconds", "Prompt process time.", e.t_prompt_total / 1e3)
        yield c("llamacpp:tokens_predicted", "Number of generation tokens processed.", e.n_predicted_total)
        yield c("llamacpp:tokens_predicted_seconds", "Predict process time.", e.t_predicted_total / 1e3)
        yield c("llamacpp:n_decode", "Number of decode rounds of the slots.", e.n_rounds)
        yield c("llamacpp:requests", "Requests answered.", e.n_requests)
        yield g("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                1e3 * e.n_prompt_total / e.t_prompt_total if e.t_prompt_total else 0.0)
        yield g("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                1e3 * e.n_predicted_total / e.t_predicted_total if e.t_predicted_total else 0.0)
        yield g("llamacpp:requests_processing", "Number of requests processing.", e.n_busy)
        yield g("llamacpp:requests_deferred", "Number of requests deferred.", e.n_waiting)
        yield c("fle:prompt_tokens_cached", "Prompt tokens served from a slot or the prompt cache.",
                e.n_cached_total)
        info = e.cache.info()
        yield g("fle:prompt_cache_bytes", "Bytes held by the RAM prompt cache.", info["size_bytes"])
        yield g("fle:prompt_cache_entries", "Entries in the RAM prompt cache.", info["n_entries"])
        yield c("fle:prompt_cache_hits", "Requests served from the RAM prompt cache.", info["n_hits"])
        yield c("fle:prompt_cache_evictions", "Entries evicted from the RAM prompt cache.", info["n_evicted"])
        yield g("fle:prompt_cache_protected_entries", "Entries of protected slots' conversations in the RAM prompt "
                "cache.", info["n_protected"])
        yield c("fle:prompt_cache_refused", "Sequences not kept: the RAM prompt cache was full of protected "
                "entries.", info["n_refused"])
        yield c("fle:draft_tokens", "MTP draft tokens proposed.", e.n_drafted_total)
        yield c("fle:draft_tokens_accepted", "MTP draft tokens accepted.", e.n_accepted_total)
        st = expert_cache_stats(e.model)
        if st is not None:
            req, hit, steps = st
            yield c("fle:expert_cache_requests", "Routed-expert lookups.", req)
            yield c("fle:expert_cache_hits", "Routed-expert lookups served from the expert cache.", hit)
            yield c("fle:expert_cache_misses", "Routed-expert lookups missing the expert cache.", req - hit)
            yield g("fle:expert_cache_hit_rate", "Expert cache hit rate.", hit / req if req else 0.0)
            yield g("fle:expert_cache_misses_per_token", "Expert cache misses per decoded token.",
                    (req - hit) / steps if steps else 0.0)


def render(engine) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(engine))
    return generate_latest(reg)
