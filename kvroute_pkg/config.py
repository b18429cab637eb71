"""kvroute's configuration: one validated pydantic model, filled from YAML, KVROUTE_* env and CLI flags.

Precedence: CLI flags > environment > file > defaults. A bad file fails at start with the field's path
and the problem (see :func:`load_config`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from kvroute.vocabulary import KVProtocol, Role
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration problem, with a message naming the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerConfig(_Strict):
    """One vLLM server (or one simulated worker)."""

    url: str = Field(description="Base URL of the worker's OpenAI server, e.g. http://10.0.0.5:8000")
    id: str | None = Field(default=None, description="Stable name; defaults to host:port of the URL")
    models: list[str] = Field(default_factory=list, description="Served models; empty = discover from /v1/models")
    role: Role = "both"
    kv_events: str | None = Field(
        default=None,
        description="ZMQ endpoint of the worker's KV-event publisher. tcp://host:port where vLLM binds "
        "(its endpoint has * or ::): kvroute connects. Omit when the worker connects to the router's "
        "shared events_bind socket.",
    )
    kv_events_topic: str = Field(default="", description="Topic the worker publishes under")
    replay: str | None = Field(default=None, description="ZMQ endpoint of the worker's replay ROUTER socket")
    p2p_host: str | None = Field(default=None, description="Host peers use for P2P lookups (default: URL host)")
    p2p_port: int = Field(default=5710, ge=1, le=65535, description="P2P control port base (+ DP rank)")
    dp_size: int = Field(default=1, ge=1, le=1024)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _defaults(self) -> WorkerConfig:
        parts = urlsplit(self.url)
        if self.id is None:
            self.id = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        if self.p2p_host is None:
            self.p2p_host = parts.hostname
        return self

    @property
    def worker_id(self) -> str:
        assert self.id is not None
        return self.id


class ModelConfig(_Strict):
    """Per-model facts the router needs for tokens and for the cost model."""

    name: str
    tokenizer: str | None = Field(
        default=None,
        description="Folder or tokenizer.json for local tokenization; python:module:Factory for a tokenizer object; "
        "render (the workers' /v1/*/render, vLLM --enable-scale-out) or render:URL[,URL] (render servers); "
        "unset: the workers' /tokenize",
    )
    chat_template: str | None = Field(default=None, description="Jinja chat template file (default: from the folder)")
    block_size: int | None = Field(default=None, ge=1, le=4096, description="Default: learnt from events")
    base_model: str | None = Field(
        default=None,
        description="Set when this name is a LoRA adapter: the base model it runs on (its requests are keyed "
        "with the base's tokens and the adapter's name, as vLLM hashes them). Default: the parent a worker's "
        "/v1/models card names",
    )
    #: Cost-model parameters (DESIGN §7); calibrated online from observed TTFTs.
    prefill_tokens_per_s: float = Field(default=10_000.0, gt=0)
    attention_coeff_s: float = Field(default=0.0, ge=0, description="Extra prefill seconds per token per 1k context")
    bytes_per_token: int = Field(default=131_072, gt=0, description="2 x layers x kv_heads x head_dim x dtype")
    transfer_per_block_s: float = Field(
        default=0.0,
        ge=0,
        description="KV-transfer cost per block beyond bytes/bandwidth (NIXL: layers x 2 descriptors)",
    )


class IndexConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = Field(
        default=False,
        description="redis_url is one seed node of a Redis Cluster (db 0): the client finds every node, "
        "follows MOVED/ASK and failovers",
    )
    redis_prefix: str = "kvr"
    block_ttl_s: int = Field(default=3600, ge=0, description="Safety-net TTL for entries whose removal was lost")
    subscribe: bool = Field(default=True, description="Run the event subscribers in this process")
    events_bind: str | None = Field(
        default=None, description="Bind one SUB socket here for workers that connect (vLLM tcp://host:port)"
    )
    worker_gone_grace_s: float = Field(default=30.0, gt=0)
    max_blocks: int | None = Field(
        default=5_000_000, ge=1, description="memory backend capacity; oldest blocks evicted beyond (None: unbounded)"
    )
    max_frame_bytes: int = Field(
        default=16 << 20, ge=1024, description="Largest KV-event frame accepted (ZMQ MAXMSGSIZE on SUB/replay)"
    )
    events_allow: list[str] = Field(
        default_factory=list, description="events_bind: only these source IP addresses may connect (ZAP)"
    )
    events_curve_secret_key: str | None = Field(
        default=None, description="events_bind: CURVE server secret key (Z85); workers must connect with CURVE"
    )
    events_curve_client_keys: list[str] = Field(
        default_factory=list, description="CURVE client public keys (Z85) allowed on events_bind (empty: any)"
    )

    @model_validator(mode="after")
    def _cluster_url(self) -> IndexConfig:
        """A bad Cluster seed fails at load, not at the first lookup; braces in the prefix would move
        every model's keys into one hash slot (or split a model across slots)."""
        if self.redis_cluster:
            problem = _cluster_url_problem(self.redis_url)
            if problem:
                raise ValueError(f"redis_url: {problem}")
            if "{" in self.redis_prefix or "}" in self.redis_prefix:
                raise ValueError("redis_prefix: no braces with redis_cluster (models are hash-tagged {model})")
        return self


def _cluster_url_problem(url: str) -> str | None:
    """Why ``url`` cannot name a Redis Cluster seed node (None when it can)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return f"a Redis Cluster seed is redis://host:port or rediss://host:port (got scheme {parts.scheme!r})"
    if parts.path.strip("/") not in ("", "0"):
        return f"Redis Cluster has database 0 only, got /{parts.path.strip('/')}"
    return None


class PoolConfig(_Strict):
    """How requests are carried out on the pool's KV-transfer protocol."""

    kv_protocol: KVProtocol = Field(
        default="none",
        description="none: aggregated only; p2p: vLLM>=0.27 offloading tier keys; nixl: two-leg pull P/D",
    )
    client_kv_params: Literal["strip", "refuse"] = "strip"
    conversation_ttl_s: float = Field(default=420.0, gt=0, description="Kept below the decoder's 480 s retention")
    kv_recompute_threshold: int = Field(default=64, ge=0)
    link_bytes_per_s: float | None = Field(
        default=None, gt=0, description="KV bandwidth between workers (default: the kvaware policy's, 12.5 GB/s)"
    )
    transfer_setup_s: float | None = Field(
        default=None, ge=0, description="Fixed cost of one KV transfer between workers (default: the policy's, 0)"
    )


class KubernetesDiscoveryConfig(_Strict):
    """Workers = the Ready pods a label selector picks in one namespace (the way an InferencePool selects
    them), followed with the Kubernetes API's list+watch. Needs get/list/watch on pods (docs/discovery.md)."""

    namespace: str | None = Field(
        default=None, description="Default: the service account's namespace in-cluster, else the kubeconfig context's"
    )
    selector: str = Field(min_length=1, description="Label selector, e.g. app=vllm,pool in (a,b)")
    port: int | None = Field(default=None, ge=1, le=65535, description="Worker HTTP port (default 8000)")
    port_name: str | None = Field(
        default=None, description="Named container port to read the HTTP port from (wins over port when present)"
    )
    events_port: int | None = Field(
        default=None, ge=1, le=65535, description="kv_events = tcp://podIP:events_port (default: ask /kv_event_sources)"
    )
    replay_port: int | None = Field(default=None, ge=1, le=65535, description="replay = tcp://podIP:replay_port")
    kubeconfig: str | None = Field(
        default=None,
        description="kubeconfig file; default: in-cluster service account, else $KUBECONFIG/~/.kube/config",
    )


class DnsDiscoveryConfig(_Strict):
    """Workers = the addresses a (headless Service) name resolves to, polled: for users without API access."""

    name: str = Field(min_length=1, description="Name to resolve, e.g. vllm.ns.svc.cluster.local")
    port: int | None = Field(default=None, ge=1, le=65535, description="Worker HTTP port for A/AAAA answers")
    srv: bool = Field(default=False, description="Resolve SRV records (host and port) instead of A/AAAA")
    interval_s: float = Field(default=5.0, gt=0, description="Seconds between resolutions")
    nameserver: str | None = Field(default=None, description="Nameserver IP (default: the system resolver's)")
    nameserver_port: int = Field(default=53, ge=1, le=65535)

    @model_validator(mode="after")
    def _port_needed(self) -> DnsDiscoveryConfig:
        if not self.srv and self.port is None:
            raise ValueError("port is required for A/AAAA lookups (or set srv: true)")
        return self


class DiscoveryConfig(_Strict):
    """Workers found at run time, beside the static ``workers`` list (which discovery never removes)."""

    kubernetes: KubernetesDiscoveryConfig | None = None
    dns: DnsDiscoveryConfig | None = None
    grace_s: float = Field(
        default=30.0, ge=0, description="A worker that disappeared is removed only after staying away this long"
    )


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    workers: list[WorkerConfig] = Field(default_factory=list)
    models: list[ModelConfig] = Field(default_factory=list)
    policy: str = "kvaware"
    policy_options: dict[str, Any] = Field(default_factory=dict)
    index: IndexConfig = Field(default_factory=IndexConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    admin_token: str | None = None
    admin_worker_allowlist: list[str] = Field(
        default_factory=list,
        description="Where workers added at run time (POST /admin/workers) may live: CIDRs (10.0.0.0/8), "
        "host names (vllm-0.vllm) or domain suffixes (.svc.cluster.local). Empty: any host but link-local "
        "(cloud metadata) addresses, which are refused unless a CIDR here covers them",
    )
    metrics_token: str | None = Field(
        default=None, description="When set, GET /metrics needs 'Authorization: Bearer <metrics_token>'"
    )
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    read_timeout_s: float = Field(default=600.0, gt=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    metrics_interval_s: float = Field(default=1.0, gt=0)
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="A client's request headers must be complete this long after its first byte"
    )
    body_timeout_s: float = Field(default=60.0, gt=0, description="A request body must arrive whole within this")
    max_connections: int = Field(
        default=4096, ge=0, description="Client connections held at once; more are refused at once (0 = no limit)"
    )
    first_byte_timeout_s: float | None = Field(
        default=120.0,
        gt=0,
        description="A stream whose first bytes take longer is given up and retried on another worker (the worker "
        "is probed at once); null = only read_timeout_s bounds it",
    )
    receipts: int = Field(
        default=1000, ge=0, description="Per-request receipts kept for GET /admin/receipts (0 = none)"
    )
    receipts_path: str | None = Field(
        default=None, description="Append every receipt to this JSON-lines file (benchmarks, offline analysis)"
    )
    routed_prefix_ttl_s: float = Field(
        default=30.0,
        ge=0,
        description="A prefix just routed to a worker counts as cached there for this long, until its KV events "
        "arrive: until the request's first bytes come back, when the engine has published them (co-locates a burst "
        "sharing a new prefix); 0 = only the index counts",
    )
    prompt_heads: bool = Field(
        default=True,
        description="Decide a long prompt the tokenizer's prefix cache covers little of on its first tokens when no "
        "worker holds all of them (none then holds more), and encode the rest after the request went out "
        "(local and plugin tokenizers; docs/routing.md)",
    )
    retry_attempts: int = Field(
        default=3,
        ge=1,
        le=16,
        description="Workers tried for one request when they fail or refuse (503/429) before answering",
    )
    refusal_cooldown_s: float = Field(
        default=1.0, ge=0, description="How long a worker that refused a request (admission control) counts as full"
    )
    early_head_ttft_s: float = Field(
        default=0.1,
        ge=0,
        description="A stream whose plan expects its first token within this many seconds gets its response head "
        "as soon as the worker's arrives, so the client reads it while the engine computes (a worker failing "
        "before the first token then ends the stream with an error event instead of a retry elsewhere); longer "
        "predictions and policies without one hold the head until the first token (0 = always)",
    )
    unhealthy_after: int = Field(default=2, ge=1, description="Failed probes before a worker is marked down")
    healthy_after: int = Field(default=1, ge=1, description="Good probes before a down worker is marked up")
    http_client: Literal["auto", "native", "aiohttp", "httpx"] = Field(
        default="auto", description="Upstream HTTP client; auto = kvroute's own (native), the cheapest per request"
    )
    heap_trim_threshold_mb: int = Field(
        default=128,
        ge=0,
        description="glibc: large freed blocks stay in the heap for reuse, up to this many MB above its top, instead "
        "of being unmapped and faulted in again per long prompt (0 = leave the allocator as it is)",
    )
    gc_gen0_threshold: int = Field(
        default=50_000,
        ge=0,
        description="After start-up: freeze the heap and set Python's young-generation GC threshold "
        "(0 = leave the garbage collector as it is)",
    )
    debug_headers: bool = Field(default=False, description="Allow X-KVRoute-Debug: 1 to return the chosen plan")
    forward_headers: list[str] = Field(
        default_factory=list,
        description="Client headers forwarded to workers besides the built-in allowlist (content-type, "
        "authorization, tracing, ...); names are case-insensitive",
    )
    log_level: str = "info"
    processes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Serving processes sharing the port (kvroute serve; SO_REUSEPORT, supervised by a parent). "
        "Above 1: Redis index written by one of them, or each subscribes to every worker (memory backend)",
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> RouterConfig:
        seen: set[str] = set()
        for worker in self.workers:
            if worker.worker_id in seen:
                raise ValueError(f"duplicate worker id {worker.worker_id!r}")
            seen.add(worker.worker_id)
        return self

    def model_config_for(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        return ModelConfig(name=name)

    def adapter_bases(self) -> dict[str, str]:
        """Configured LoRA adapters -> their base model (``models[].base_model``)."""
        return {m.name: m.base_model for m in self.models if m.base_model and m.base_model != m.name}


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(root)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """KVROUTE_POLICY=x, KVROUTE_INDEX__BACKEND=redis, KVROUTE_WORKERS='[{"url": ...}]' (JSON values ok)."""
    data: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("KVROUTE_") or name == "KVROUTE_CONFIG":
            continue
        path = name[len("KVROUTE_") :].lower().split("__")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> RouterConfig:
    """Build the config from a YAML file, the environment and CLI overrides (highest precedence)."""
    environ = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    source = "defaults"
    path = path or environ.get("KVROUTE_CONFIG")
    if path:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded
    data = _merge(data, _env_overrides(environ))
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
