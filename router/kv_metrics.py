"""Metrics of KV-aware routing: predictions against what the engine reported, fallbacks, rewrites."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class KVRouteMetrics:
    """Registered on the router's own registry (one instance per app)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.decisions = Counter(
            "kvroute_route_plans_total", "Plans carried out, by policy and shape", ["policy", "shape"], registry=r
        )
        self.predicted = Counter(
            "kvroute_predicted_cached_tokens_total", "Cached prompt tokens the plan predicted", ["model"], registry=r
        )
        self.reported = Counter(
            "kvroute_reported_cached_tokens_total",
            "Cached prompt tokens the engine reported for routed requests with a prediction",
            ["model"],
            registry=r,
        )
        self.predicted_by_tier = Counter(
            "kvroute_predicted_hit_tokens_total",
            "Predicted cached tokens by the tier they load from",
            ["tier"],
            registry=r,
        )
        self.predicted_by_source = Counter(
            "kvroute_predicted_cached_tokens_by_source_total",
            "Predicted cached tokens named the way vLLM's prompt_tokens_cached_by_source counts them",
            ["source"],
            registry=r,
        )
        self.fidelity = Counter(
            "kvroute_prediction_fidelity_total",
            "Checked predictions per API surface (completions, chat, messages, responses, and +salted): exact, "
            "over (predicted more "
            "than the engine served: a tokenizer/template mismatch or a stale index) or under",
            ["surface", "outcome"],
            registry=r,
        )
        self.stale = Counter(
            "kvroute_stale_decisions_total",
            "Decisions that predicted a hit the engine did not have (more than a block short)",
            ["model"],
            registry=r,
        )
        self.checked = Counter(
            "kvroute_checked_decisions_total",
            "Decisions whose prediction could be checked against the engine's report",
            ["model"],
            registry=r,
        )
        self.bytes_moved = Counter(
            "kvroute_estimated_kv_bytes_moved_total",
            "KV bytes the chosen plans move between workers (estimate)",
            registry=r,
        )
        self.routed_prefix_hits = Counter(
            "kvroute_routed_prefix_hits_total",
            "Lookups where a prefix just routed to a worker (its KV events not yet in) counted as cached there",
            registry=r,
        )
        self.prompt_heads = Counter(
            "kvroute_prompt_heads_total",
            "Long new prompts looked up by their head first: decided on it (nobody held past it), encoded whole "
            "before deciding (a worker held the whole head), or a head whose tokens the whole prompt's then "
            "contradicted (mismatch)",
            ["outcome"],
            registry=r,
        )
        self.fallbacks = Counter(
            "kvroute_kv_fallbacks_total",
            "Requests whose KV plan fell back (index down, tokenizer failed, prefill leg failed)",
            ["reason"],
            registry=r,
        )
        self.unrendered = Counter(
            "kvroute_unrendered_requests_total",
            "Generation requests routed by load because their prompt's tokens cannot be known exactly here "
            "(media for a local tokenizer, a previous response kept by one engine...), by surface and reason",
            ["surface", "reason"],
            registry=r,
        )
        self.render_failures = Counter(
            "kvroute_render_failures_total",
            "Render answers that could not be used (malformed, oversized, render turned off): the worker is "
            "not asked to render for a while",
            ["reason"],
            registry=r,
        )
        self.event_sources = Gauge(
            "kvroute_kv_event_sources",
            "Workers whose KV events this router subscribes to (0 with workers: routing by load only)",
            registry=r,
            multiprocess_mode="livemax",  # several serving processes: the one that subscribes
        )
        self.load_only_workers = Gauge(
            "kvroute_workers_without_kv_events",
            "Workers routed by load only: no KV-event source configured or discovered",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.client_params = Counter(
            "kvroute_client_kv_params_removed_total",
            "Client-supplied kv_transfer_params keys removed before forwarding",
            registry=r,
        )
        self.conversations = Counter(
            "kvroute_conversation_reuse_total",
            "Conversation-store outcomes (stored, taken, reused)",
            ["outcome"],
            registry=r,
        )
