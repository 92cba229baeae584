"""``/metrics``: Prometheus text (prometheus-client), llama-server's
``llamacpp:*`` counters and gauges plus FLE's own: the prompt cache, MTP
drafts and, where the model runs one, the expert cache's hit rate, misses
per token and host time per token (tokens: the rows the steps ran; a
batched step of the slots carries one per slot)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def _tokens(st) -> int:
    # the rows the steps ran where the stats count them (the engine's cache), else the steps
    return int(getattr(st, "tokens", st.steps))


def expert_cache_stats(model) -> tuple[int, int, int] | None:
    """(requests, hits, tokens) of the model's expert cache, or None without one."""
    cache = getattr(model, "cache", None)
    st = getattr(cache, "stats", None)
    if st is not None and hasattr(st, "hits"):
        return int(st.requests), int(st.hits), _tokens(st)
    req = hit = tokens = 0
    found = False
    for moe in getattr(model, "moe_layers", lambda: [])() if callable(getattr(model, "moe_layers", None)) else []:
        s = getattr(getattr(moe, "store", None), "stats", None)
        if s is not None:
            found = True
            req, hit, tokens = req + s.requests, hit + s.hits, max(tokens, _tokens(s))
    return (req, hit, tokens) if found else None


def expert_cache_host_seconds(model) -> tuple[float, int] | None:
    """(host seconds of the expert cache's policy and step boundaries,
    tokens) of the engine's cache, or None where the model has no such cache."""
    st = getattr(getattr(model, "cache", None), "stats", None)
    if st is None or not hasattr(st, "host_seconds"):
        return None
    return float(st.host_seconds), _tokens(st)


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
            req, hit, tokens = st
            yield c("fle:expert_cache_requests", "Routed-expert lookups.", req)
            yield c("fle:expert_cache_hits", "Routed-expert lookups served from the expert cache.", hit)
            yield c("fle:expert_cache_misses", "Routed-expert lookups missing the expert cache.", req - hit)
            yield g("fle:expert_cache_hit_rate", "Expert cache hit rate.", hit / req if req else 0.0)
            yield g("fle:expert_cache_misses_per_token", "Expert cache misses per decoded token.",
                    (req - hit) / tokens if tokens else 0.0)
        host = expert_cache_host_seconds(e.model)
        if host is not None:
            sec, tokens = host
            yield g("fle:expert_cache_host_seconds_per_token", "Host time of the expert cache's policy and step "
                    "boundaries per decoded token, in seconds.", sec / tokens if tokens else 0.0)


def render(engine) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(engine))
    return generate_latest(reg)
