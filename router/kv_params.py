"""Request bodies for each KV-transfer protocol of DESIGN §6, built from a RoutePlan. Pure functions.

Safety rules enforced here, whatever the plan says:

* the client never chooses routing: its ``kv_transfer_params`` are stripped (or the request refused);
* peers are only registered workers: hosts and P2P ports come from :class:`WorkerView`, never from a body;
* a forbidden key combination is never produced: every body passes :func:`check_kv_transfer_params`
  before it leaves this module (vLLM accepts only ``remote_decoder`` + ``remote_kv_source`` together).

Flows: ``none`` sends one local body. ``p2p`` (vLLM >= 0.27 offloading tier) sends one body, or a
prefill-only leg with ``remote_decoder`` then the client's leg with ``remote_prefiller``, with
router-allocated ``kv_request_id`` s. ``nixl`` (NixlConnector pull) sends a prefill-only leg, then the
decode leg carrying the ``kv_transfer_params`` the prefiller returned. Every leg of one request carries
the same ``X-Request-Id``.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvroute.policies.base import RoutePlan, WorkerView
from kvroute.policies.tier_policy import validate_tiers
from kvroute.router.surfaces import CHAT, MESSAGES, RESPONSES
from kvroute.vocabulary import KVProtocol

LegKind = Literal["local", "prefill", "decode"]

P2P_KEYS = ("remote_decoder", "remote_prefiller", "remote_kv_source")
NIXL_KEYS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "tp_size",
    "remote_num_tokens",
)
#: Remote-key sets vLLM accepts in one request; everything else is refused by the engine.
ALLOWED_P2P_SETS = frozenset(
    {
        frozenset(),
        frozenset({"remote_decoder"}),
        frozenset({"remote_prefiller"}),
        frozenset({"remote_kv_source"}),
        frozenset({"remote_decoder", "remote_kv_source"}),
    }
)
NIXL_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
REQUEST_ID_HEADER = "X-Request-Id"


class KVParamsError(ValueError):
    """A body or worker answer that cannot be rewritten safely; the message says what and why."""


def new_kv_request_id() -> str:
    """A transfer id unique per transfer (vLLM matches producer and consumer by it)."""
    return f"kvr-{uuid.uuid4().hex}"


# -- client input -------------------------------------------------------------------------------------


def sanitize_client_body(
    body: Any, mode: Literal["strip", "refuse"] = "strip", allow: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], list[str]]:
    """A copy of ``body`` without client ``kv_transfer_params`` keys (except ``allow``), and what went.

    In ``refuse`` mode any such key raises :class:`KVParamsError` instead (answer 400).
    """
    if not isinstance(body, dict):
        raise KVParamsError("request body must be a JSON object")
    out = dict(body)
    if "kv_transfer_params" not in out:
        return out, []
    params = out.pop("kv_transfer_params")
    if not isinstance(params, dict):
        if mode == "refuse":
            raise KVParamsError("kv_transfer_params is set by the router, not by clients")
        return out, ["kv_transfer_params"]
    removed = sorted(k for k in params if k not in allow)
    if removed and mode == "refuse":
        raise KVParamsError(f"kv_transfer_params keys {removed} are set by the router, not by clients")
    kept = {k: v for k, v in params.items() if k in allow}
    if kept:
        out["kv_transfer_params"] = kept
    return out, removed


# -- validation ---------------------------------------------------------------------------------------


def _check_peer(name: str, value: Any, needs_address: bool) -> None:
    if not isinstance(value, dict):
        raise KVParamsError(f"{name} must be an object")
    if not isinstance(value.get("kv_request_id"), str) or not value["kv_request_id"]:
        raise KVParamsError(f"{name}.kv_request_id must be a non-empty string")
    if needs_address:
        host, port = value.get("remote_host"), value.get("remote_port")
        if not isinstance(host, str) or not host:
            raise KVParamsError(f"{name}.remote_host must be a non-empty string")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise KVParamsError(f"{name}.remote_port must be a port number")


def check_kv_transfer_params(params: Mapping[str, Any]) -> None:
    """Raise :class:`KVParamsError` unless ``params`` is a combination vLLM accepts."""
    present = frozenset(k for k in P2P_KEYS if k in params)
    if present not in ALLOWED_P2P_SETS:
        raise KVParamsError(f"forbidden kv_transfer_params combination: {sorted(present)}")
    if present and any(k in params for k in NIXL_KEYS):
        raise KVParamsError("P2P keys cannot be mixed with NixlConnector keys")
    if params.get("do_remote_decode") is True and params.get("do_remote_prefill") is True:
        raise KVParamsError("do_remote_decode and do_remote_prefill cannot both be true")
    for key in present:
        _check_peer(key, params[key], needs_address=key != "remote_decoder")
    if "kv_load_tiers" in params:
        try:
            validate_tiers(params["kv_load_tiers"])
        except ValueError as exc:
            raise KVParamsError(str(exc)) from None
    for key in ("max_offload_tokens", "max_load_tokens"):
        if key in params:
            value = params[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KVParamsError(f"{key} must be an integer >= 0")


def peer_address(worker: WorkerView) -> tuple[str, int]:
    """A registered worker's P2P control endpoint; raise when it has none (it cannot be a peer)."""
    if not worker.p2p_host or not worker.p2p_port:
        raise KVParamsError(f"worker {worker.id!r} has no P2P endpoint configured")
    return worker.p2p_host, worker.p2p_port


# -- legs -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Leg:
    """One HTTP request to one worker."""

    worker_id: str
    kind: LegKind
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _with_params(body: Mapping[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params:
        check_kv_transfer_params(params)
        out["kv_transfer_params"] = params
    return out


def _tier_params(plan: RoutePlan) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if plan.kv_load_tiers is not None:
        params["kv_load_tiers"] = [dict(t) for t in plan.kv_load_tiers]
    if plan.max_offload_tokens is not None:
        params["max_offload_tokens"] = plan.max_offload_tokens
    if plan.max_load_tokens is not None:
        params["max_load_tokens"] = plan.max_load_tokens
    return params


def prefill_only(body: Mapping[str, Any], route: str = CHAT) -> dict[str, Any]:
    """The client body shaped for a prefill-only leg of ``route``: one token, not streamed. Responses
    count tokens in ``max_output_tokens`` (and the leg's answer is not stored); an Anthropic thinking
    budget (no template effect) goes, since vLLM wants it below ``max_tokens``."""
    out = dict(body)
    out["stream"] = False
    if route == RESPONSES:
        out["max_output_tokens"] = 1
        out["store"] = False
    else:
        out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if route == MESSAGES and isinstance(out.get("thinking"), dict) and out["thinking"].get("type") != "disabled":
        out.pop("thinking")
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    return out


def _source_params(source: WorkerView, id_factory: Callable[[], str]) -> dict[str, Any]:
    host, port = peer_address(source)
    return {"kv_request_id": id_factory(), "remote_host": host, "remote_port": port}


@dataclass(slots=True)
class Legs:
    """The legs of one request, in order. For ``nixl`` the decode leg is built from the prefill answer."""

    request_id: str
    protocol: KVProtocol
    plan: RoutePlan
    client_body: dict[str, Any]
    prefill: Leg | None
    final: Leg | None
    #: The client's route (how a prefill-only leg limits its output).
    route: str = CHAT

    @property
    def headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.request_id}

    def decode_leg(self, prefill_response: Any) -> Leg:
        """The leg whose answer goes to the client. ``nixl``: needs the prefiller's JSON answer."""
        if self.final is not None:
            return self.final
        params = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
        if not isinstance(params, dict) or not params:
            raise KVParamsError("the prefill worker's answer carried no kv_transfer_params")
        body = dict(self.client_body)
        body["kv_transfer_params"] = copy.deepcopy(params)  # forwarded unchanged, as NixlConnector expects
        return Leg(self.plan.decode, "decode", body, self.headers)

    def fallback_leg(self) -> Leg:
        """Local recomputation on the decode worker: used when a prefill leg or peer fails."""
        return Leg(self.plan.decode, "local", _with_params(self.client_body, {}), self.headers)


def build_legs(
    body: Mapping[str, Any],
    plan: RoutePlan,
    workers: Mapping[str, WorkerView],
    *,
    protocol: KVProtocol,
    request_id: str,
    conversation_params: Mapping[str, Any] | None = None,
    id_factory: Callable[[], str] = new_kv_request_id,
    route: str = CHAT,
) -> Legs:
    """Turn a (sanitized) client body and a plan into legs for the pool's ``protocol``.

    ``conversation_params``: the previous turn's decoder ``kv_transfer_params`` from the conversation
    store, used only when ``plan.reuse_conversation`` (nixl bidirectional reuse).
    """
    for wid in {plan.prefill, plan.decode, *([plan.kv_source] if plan.kv_source else [])}:
        if wid not in workers:
            raise KVParamsError(f"plan names unknown worker {wid!r}")
    client = dict(body)
    client.pop("kv_transfer_params", None)
    headers = {REQUEST_ID_HEADER: request_id}
    legs = Legs(request_id, protocol, plan, client, None, None, route)
    if protocol == "none":
        if plan.disaggregated or plan.kv_source:
            raise KVParamsError("pool protocol 'none' can only carry aggregated plans")
        legs.final = Leg(plan.decode, "local", _with_params(client, {}), headers)
    elif protocol == "p2p":
        _p2p(legs, plan, workers, id_factory, headers)
    elif protocol == "nixl":
        _nixl(legs, plan, conversation_params, headers)
    else:
        raise KVParamsError(f"unknown kv protocol {protocol!r}")
    return legs


def _p2p(
    legs: Legs,
    plan: RoutePlan,
    workers: Mapping[str, WorkerView],
    id_factory: Callable[[], str],
    headers: dict[str, str],
) -> None:
    tiers = _tier_params(plan)
    source = workers[plan.kv_source] if plan.kv_source and plan.kv_source != plan.prefill else None
    if not plan.disaggregated:
        params = dict(tiers)
        if source is not None:
            params["remote_kv_source"] = _source_params(source, id_factory)
        legs.final = Leg(plan.decode, "local", _with_params(legs.client_body, params), headers)
        return
    transfer = id_factory()
    prefill_params: dict[str, Any] = {**tiers, "remote_decoder": {"kv_request_id": transfer}}
    if source is not None:
        prefill_params["remote_kv_source"] = _source_params(source, id_factory)
    host, port = peer_address(workers[plan.prefill])
    prefiller = {"kv_request_id": transfer, "remote_host": host, "remote_port": port}
    decode_params = {"remote_prefiller": prefiller}
    prefill_body = _with_params(prefill_only(legs.client_body, legs.route), prefill_params)
    legs.prefill = Leg(plan.prefill, "prefill", prefill_body, headers)
    legs.final = Leg(plan.decode, "decode", _with_params(legs.client_body, decode_params), headers)


def _nixl(legs: Legs, plan: RoutePlan, conversation_params: Mapping[str, Any] | None, headers: dict[str, str]) -> None:
    if plan.kv_source:
        raise KVParamsError("NixlConnector pools have no kv_source peers")
    if not plan.disaggregated:
        legs.final = Leg(plan.decode, "local", _with_params(legs.client_body, {}), headers)
        return
    params = dict(NIXL_PREFILL_PARAMS)
    if plan.reuse_conversation and conversation_params:
        # Bidirectional reuse: the prefiller pulls the previous turn from the old decoder, computes the
        # rest, and produces for the new decoder. Hosts come from the stored answer of a registered worker.
        stored = {k: copy.deepcopy(v) for k, v in conversation_params.items() if k not in P2P_KEYS}
        params = {**stored, "do_remote_decode": True, "do_remote_prefill": False}
    prefill_body = _with_params(prefill_only(legs.client_body, legs.route), params)
    legs.prefill = Leg(plan.prefill, "prefill", prefill_body, headers)


def conversation_params_from_response(response: Any) -> dict[str, Any] | None:
    """The decoder's ``kv_transfer_params`` from a final non-streamed answer, if it returned usable ones.

    Streamed answers never carry them (vLLM's chunks omit the field): the router stores nothing then,
    and the next turn relies on the index (P2P ``remote_kv_source``) or recomputes (docs/routing.md).
    """
    if not isinstance(response, dict):
        return None
    params = response.get("kv_transfer_params")
    if not isinstance(params, dict) or not params or any(k in params for k in P2P_KEYS):
        return None
    return copy.deepcopy(params)
