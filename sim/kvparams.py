"""``kv_transfer_params`` parsed and validated exactly as DESIGN §6 describes vLLM's request-level protocol.

Two families exist: the P2P/offloading tier (``remote_decoder`` / ``remote_prefiller`` /
``remote_kv_source`` + ``kv_load_tiers`` / ``max_offload_tokens`` / ``max_load_tokens``) and NixlConnector pull P/D
(``do_remote_decode`` / ``do_remote_prefill`` + ``remote_*``). Forbidden combinations raise
:class:`KVParamsError`, which the API turns into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

P2P_KEYS = ("remote_decoder", "remote_prefiller", "remote_kv_source")
ALLOWED_COMBINATION = frozenset({"remote_decoder", "remote_kv_source"})
MEDIA = ("CPU", "STORAGE")
LOCALITIES = ("LOCAL", "REMOTE")


class KVParamsError(ValueError):
    """Invalid or forbidden ``kv_transfer_params`` (an HTTP 400)."""


@dataclass(frozen=True, slots=True)
class PeerRef:
    kv_request_id: str
    host: str | None = None
    port: int | None = None


@dataclass(frozen=True, slots=True)
class NixlRemote:
    """Where a NIXL pull reads from: the other side's retained blocks."""

    request_id: str
    engine_id: str | None
    block_ids: list[int]
    host: str
    port: int
    num_tokens: int | None


@dataclass(frozen=True, slots=True)
class KVParams:
    remote_decoder: PeerRef | None = None
    remote_prefiller: PeerRef | None = None
    remote_kv_source: PeerRef | None = None
    kv_load_tiers: tuple[tuple[str, str], ...] | None = None
    max_offload_tokens: int | None = None
    #: Cap on the tokens loaded from offload tiers (CPU, P2P) past the local GPU prefix; None = no cap.
    max_load_tokens: int | None = None
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    nixl_remote: NixlRemote | None = None

    @property
    def remote_loads_allowed(self) -> bool:
        """``kv_load_tiers`` absent = every tier; present = only if some entry is REMOTE."""
        if self.kv_load_tiers is None:
            return True
        return any(locality == "REMOTE" for _, locality in self.kv_load_tiers)

    @property
    def is_nixl(self) -> bool:
        return self.do_remote_decode or self.do_remote_prefill


def _str(value: object, what: str, *, max_len: int = 256) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise KVParamsError(f"kv_transfer_params.{what} must be a non-empty string (at most {max_len} chars)")
    return value


def _port(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise KVParamsError(f"kv_transfer_params.{what} must be a port number (1-65535)")
    return value


def _bool(value: object, what: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise KVParamsError(f"kv_transfer_params.{what} must be a boolean")
    return value


def _peer(raw: object, key: str, *, needs_address: bool) -> PeerRef:
    if not isinstance(raw, dict):
        raise KVParamsError(f"kv_transfer_params.{key} must be an object")
    kv_request_id = _str(raw.get("kv_request_id"), f"{key}.kv_request_id")
    if not needs_address:
        return PeerRef(kv_request_id)
    return PeerRef(
        kv_request_id,
        _str(raw.get("remote_host"), f"{key}.remote_host"),
        _port(raw.get("remote_port"), f"{key}.remote_port"),
    )


def _tiers(raw: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list):
        raise KVParamsError("kv_transfer_params.kv_load_tiers must be a list")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise KVParamsError(f"kv_transfer_params.kv_load_tiers[{i}] must be an object")
        medium = str(item.get("medium", "")).upper()
        locality = str(item.get("locality", "LOCAL")).upper()
        if medium not in MEDIA or locality not in LOCALITIES:
            raise KVParamsError(
                f"kv_transfer_params.kv_load_tiers[{i}] needs medium in {MEDIA} and locality in {LOCALITIES}"
            )
        out.append((medium, locality))
    return tuple(out)


def _nixl_remote(raw: dict[str, Any]) -> NixlRemote | None:
    block_ids = raw.get("remote_block_ids")
    if block_ids is None:
        return None
    if not isinstance(block_ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        raise KVParamsError("kv_transfer_params.remote_block_ids must be a list of integers")
    num_tokens = raw.get("remote_num_tokens")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
        raise KVParamsError("kv_transfer_params.remote_num_tokens must be a non-negative integer")
    engine = raw.get("remote_engine_id")
    return NixlRemote(
        request_id=_str(raw.get("remote_request_id"), "remote_request_id"),
        engine_id=engine if isinstance(engine, str) else None,
        block_ids=block_ids,
        host=_str(raw.get("remote_host"), "remote_host"),
        port=_port(raw.get("remote_port"), "remote_port"),
        num_tokens=num_tokens,
    )


def _max_load_tokens(raw: object) -> int | None:
    """vLLM 0.33's OffloadingConnector reads ``max_load_tokens`` leniently: a non-negative int (``type(raw)
    is int``, so never a bool) caps the load, anything else is ignored with a warning, never refused
    (``RequestOffloadState.__post_init__`` in ``offloading/scheduler.py``)."""
    if type(raw) is int and raw >= 0:
        return raw
    return None


def parse_kv_params(raw: object) -> KVParams | None:
    """Validate a request's ``kv_transfer_params`` (None when absent)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KVParamsError("kv_transfer_params must be an object")
    present = [key for key in P2P_KEYS if raw.get(key) is not None]
    if len(present) > 1 and frozenset(present) != ALLOWED_COMBINATION:
        raise KVParamsError(
            f"kv_transfer_params: {' + '.join(present)} may not be combined; only "
            "remote_decoder + remote_kv_source can be used together"
        )
    do_decode = _bool(raw.get("do_remote_decode"), "do_remote_decode")
    do_prefill = _bool(raw.get("do_remote_prefill"), "do_remote_prefill")
    if do_decode and do_prefill:
        raise KVParamsError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if present and (do_decode or do_prefill):
        raise KVParamsError(
            f"kv_transfer_params: {present[0]} (P2P tier) cannot be combined with "
            "NixlConnector do_remote_decode/do_remote_prefill"
        )
    max_offload = raw.get("max_offload_tokens")
    if max_offload is not None and (
        isinstance(max_offload, bool) or not isinstance(max_offload, int) or max_offload < 0
    ):
        raise KVParamsError("kv_transfer_params.max_offload_tokens must be an integer >= 0")
    tiers = raw.get("kv_load_tiers")
    nixl = _nixl_remote(raw) if (do_decode or do_prefill) else None
    if do_prefill and nixl is None:
        raise KVParamsError(
            "kv_transfer_params: do_remote_prefill needs remote_block_ids, "
            "remote_request_id, remote_host and remote_port"
        )
    return KVParams(
        remote_decoder=_peer(raw["remote_decoder"], "remote_decoder", needs_address=False)
        if raw.get("remote_decoder") is not None
        else None,
        remote_prefiller=_peer(raw["remote_prefiller"], "remote_prefiller", needs_address=True)
        if raw.get("remote_prefiller") is not None
        else None,
        remote_kv_source=_peer(raw["remote_kv_source"], "remote_kv_source", needs_address=True)
        if raw.get("remote_kv_source") is not None
        else None,
        kv_load_tiers=_tiers(tiers) if tiers is not None else None,
        max_offload_tokens=max_offload,
        max_load_tokens=_max_load_tokens(raw.get("max_load_tokens")),
        do_remote_decode=do_decode,
        do_remote_prefill=do_prefill,
        nixl_remote=nixl,
    )
