"""Admin endpoints for the prefix index, and a small live HTML page.

:func:`index_admin_router` returns a FastAPI ``APIRouter`` with paths relative to the admin mount
(``/index/stats``, ``/index/workers/{id}``, ``/index/blocks/{key}``, ``/index/lookup``, and ``/``
for the page); include it under ``/admin``. A bearer token, when given, guards the JSON endpoints;
the page itself holds no data and calls them with the token the operator supplies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from kvroute.indexer.backend import IndexUnavailable
from kvroute.indexer.service import KVIndexer
from kvroute.router.admin_auth import Token, check_admin
from kvroute.router.errors import ApiError
from kvroute.vocabulary import Tier
from pydantic import BaseModel, Field, model_validator

#: (model, prompt, messages) -> token ids, exactly as the engine will see them.
Tokenize = Callable[[str, str | None, list[dict[str, Any]] | None], Awaitable[Sequence[int]]]

MAX_LOOKUP_TOKENS = 2_000_000


class LookupBody(BaseModel):
    """A prompt to look up: exactly one of ``prompt``, ``messages`` or ``token_ids``."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    token_ids: list[int] | None = Field(default=None, max_length=MAX_LOOKUP_TOKENS)
    lora_name: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> LookupBody:
        given = [x is not None for x in (self.prompt, self.messages, self.token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or token_ids")
        if self.token_ids is not None and any(not 0 <= t < 1 << 32 for t in self.token_ids):
            raise ValueError("token_ids must be integers in [0, 2**32)")
        return self


def _bearer(token: Token, read_only: bool | None = None) -> Callable[[Request], Awaitable[None]]:
    """``token`` may be a callable, read on each request (a reloaded config can change it)."""

    async def check(request: Request) -> None:
        try:
            check_admin(request, token, read_only=read_only)
        except ApiError as exc:
            raise HTTPException(exc.status, exc.message, headers={"WWW-Authenticate": "Bearer"}) from None

    return check


def _unavailable(exc: IndexUnavailable) -> HTTPException:
    return HTTPException(503, f"index backend unavailable: {exc}")


def _tiers(bits: int) -> list[str]:
    return [t.name for t in Tier if bits & t and t.name]


def _parse_key(raw: str) -> int:
    try:
        key = int(raw, 16) if raw.lower().startswith("0x") else int(raw)
    except ValueError:
        raise HTTPException(400, f"block key must be a decimal or 0x-hex 64-bit integer, got {raw[:40]!r}") from None
    if not 0 <= key < 1 << 64:
        raise HTTPException(400, "block key must fit in 64 bits")
    return key


def index_admin_router(
    indexer: KVIndexer,
    token: str | Callable[[], str | None] | None = None,
    tokenize: Tokenize | None = None,
    base_of: Callable[[str], str | None] | None = None,
) -> APIRouter:
    """The index admin API over ``indexer``; ``tokenize`` enables ``prompt``/``messages`` lookups, ``base_of``
    (a LoRA adapter's base model) lets an adapter's name be looked up as its requests are."""
    router = APIRouter(tags=["index"])

    def resolve(model: str, lora_name: str | None) -> tuple[str, str | None]:
        base = base_of(model) if base_of is not None else None
        return (base, lora_name or model) if base else (model, lora_name)

    guarded = [Depends(_bearer(token))]
    lookup_guard = [Depends(_bearer(token, read_only=True))]  # a POST that only computes

    @router.get("/index/stats", dependencies=guarded, summary="Blocks per worker and tier, event rates, lag")
    async def stats() -> dict[str, Any]:
        return await indexer.stats()

    @router.get("/index/workers/{worker_id}", dependencies=guarded, summary="One worker's index state")
    async def worker(worker_id: str) -> dict[str, Any]:
        info = await indexer.worker_info(worker_id)
        if info is None:
            raise HTTPException(404, f"unknown worker {worker_id!r}")
        return info

    @router.delete(
        "/index/workers/{worker_id}",
        dependencies=guarded,
        summary="Forget every block of a worker (all its data-parallel ranks)",
    )
    async def purge(worker_id: str) -> dict[str, Any]:
        try:
            count = await indexer.purge_worker(worker_id, "admin")
        except IndexUnavailable as exc:
            raise _unavailable(exc) from None
        return {"worker": worker_id, "purged_ranks": count}

    @router.get("/index/blocks/{key}", dependencies=guarded, summary="Which workers hold one block key")
    async def block(key: str, model: str = Query(min_length=1)) -> dict[str, Any]:
        value = _parse_key(key)
        try:
            holders = await indexer.backend.block_workers(resolve(model, None)[0], value)
        except IndexUnavailable as exc:
            raise _unavailable(exc) from None
        return {
            "model": model,
            "key": value,
            "key_hex": f"0x{value:016x}",
            "workers": {w: {"bits": bits, "tiers": _tiers(bits)} for w, bits in sorted(holders.items())},
        }

    @router.post(
        "/index/lookup",
        dependencies=lookup_guard,
        summary="Per-worker, per-tier match of a prompt (model + prompt | messages | token_ids)",
    )
    async def lookup(body: LookupBody) -> dict[str, Any]:
        tokens: Sequence[int] | None = body.token_ids
        model, lora_name = resolve(body.model, body.lora_name)
        if tokens is None:
            if tokenize is None:
                raise HTTPException(400, "this server has no tokenizer here: send token_ids")
            try:
                tokens = await tokenize(model, body.prompt, body.messages)
            except (ValueError, LookupError) as exc:
                raise HTTPException(400, f"cannot tokenize: {exc}") from None
        try:
            result = await indexer.lookup_tokens(model, tokens, lora_name, body.cache_salt)
        except IndexUnavailable as exc:
            raise _unavailable(exc) from None
        size = result.block_size or 0
        rows = [
            {
                "worker": m.worker_id,
                "blocks": m.blocks,
                "tokens": m.blocks * size,
                "gpu": m.gpu,
                "cpu": m.cpu,
                "storage": m.storage,
                "remote": m.remote,
            }
            for m in sorted(result.matches.values(), key=lambda m: (-m.blocks, m.worker_id))
        ]
        return {
            "model": body.model,
            "lora_name": lora_name,
            "block_size": result.block_size,
            "prompt_tokens": len(tokens),
            "num_blocks": result.num_blocks,
            "matches": rows,
            "first_keys_hex": [f"0x{k:016x}" for k in result.keys[:4]],
        }

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    return router


#: The live page: polls ``index/stats`` relative to itself; the token comes from ``?token=`` or a prompt.
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvroute index</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
 h1{font-size:1.3em} .muted{color:#777} .bad{color:#b00;font-weight:bold} .ok{color:#070}
 table{border-collapse:collapse;margin-top:1em}
 th,td{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:right}
 th:first-child,td:first-child{text-align:left} .bar{display:inline-block;height:.7em;background:#4a7}
 .bar.cpu{background:#49c} .bar.sto{background:#a7c}
</style></head><body>
<h1>kvroute &middot; prefix index</h1>
<div id="summary" class="muted">loading&hellip;</div>
<table><thead><tr><th>worker</th><th>model</th><th>blocks</th><th>GPU</th><th>CPU</th><th>STORAGE</th>
<th>events/s</th><th>last event (s ago)</th><th>lag (s)</th><th>gaps</th><th>replays</th><th>purges</th>
<th>dropped</th><th></th></tr></thead><tbody id="rows"></tbody></table>
<script>
const params = new URLSearchParams(location.search);
let token = params.get("token") || sessionStorage.getItem("kvrouteToken") || "";
const base = location.pathname.endsWith("/") ? location.pathname : location.pathname + "/";
function esc(s){return String(s ?? "").replace(/[&<>"']/g, c => "&#" + c.charCodeAt(0) + ";");}
function fmt(v){return v === null || v === undefined ? "&ndash;" : esc(v);}
async function refresh(){
  const headers = token ? {Authorization: "Bearer " + token} : {};
  let r;
  try { r = await fetch(base + "index/stats", {headers}); }
  catch (e) { show("unreachable: " + e, true); return; }
  if (r.status === 401) {
    token = prompt("Admin token") || ""; sessionStorage.setItem("kvrouteToken", token); return;
  }
  if (!r.ok) { show("HTTP " + r.status, true); return; }
  const s = await r.json();
  const up = s.backend_ok;
  show(`backend <b class="${up ? "ok" : "bad"}">${esc(s.backend)} ${up ? "up" : "DOWN"}</b>
    &middot; ${esc(s.blocks)} blocks &middot; ${esc(s.events_per_s)} events/s &middot; gaps ${esc(s.gaps)}
    &middot; replays ${esc(s.replays)} &middot; purges ${esc(s.purges)}
    &middot; block sizes ${esc(JSON.stringify(s.block_sizes))}`, false);
  const max = Math.max(1, ...s.workers.map(w => w.blocks));
  document.getElementById("rows").innerHTML = s.workers.map(w => {
    const t = w.by_tier || {};
    const bar = (n, cls) =>
      `<span class="bar ${cls}" style="width:${Math.round(120 * (n || 0) / max)}px"></span>`;
    return `<tr><td>${esc(w.id)}</td><td>${esc(w.model)}</td><td>${esc(w.blocks)}</td><td>${fmt(t.GPU)}</td>
      <td>${fmt(t.CPU)}</td><td>${fmt(t.STORAGE)}</td><td>${fmt(w.events_per_s)}</td>
      <td>${fmt(w.seconds_since_last_event)}</td><td>${fmt(w.lag_s)}</td><td>${fmt(w.gaps)}</td>
      <td>${fmt(w.replays)}</td><td>${fmt(w.purges)}</td><td>${fmt(w.dropped)}</td>
      <td style="text-align:left">${bar(t.GPU, "")}${bar(t.CPU, "cpu")}${bar(t.STORAGE, "sto")}</td></tr>`;
  }).join("");
}
function show(html, bad){const el = document.getElementById("summary"); el.innerHTML = html;
  el.className = bad ? "bad" : "";}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
