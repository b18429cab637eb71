"""The simulated engine: admission (max running sequences, FCFS, KV space), prefill on a serialised GPU
timeline, decode steps whose cost grows with the batch, and the KV-transfer hooks.

TTFT = queue wait + remote transfer + CPU-tier promotion + prefill of the uncached tokens; every
duration is a model duration x ``time_scale``. A data-parallel worker runs one engine per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.indexer.events import BlockHash, KVEvent
from kvroute.indexer.keys import request_extra_keys
from kvroute.sim.kvcache import Allocation, BlockExtra, PagedCache
from kvroute.sim.kvparams import KVParams
from kvroute.sim.metrics import MetricFamilies, SimMetrics
from kvroute.sim.options import WorkerOptions
from kvroute.sim.output import output_token_ids
from kvroute.sim.p2p import P2PClient
from kvroute.sim.timing import decode_step_seconds, prefill_seconds, promote_seconds
from kvroute.sim.transfers import Transfers


class EngineError(ValueError):
    """A request the engine cannot serve (an HTTP 400)."""


@dataclass(slots=True)
class EngineRequest:
    """One request as the engine sees it (already tokenized and validated by the API); the engine fills in
    what the answer reports (cached tokens, output count, ``kv_transfer_params`` out)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    kv: KVParams | None = None
    cache_salt: str | None = None
    #: The request's session (``session_id`` field, ``X-Session-ID`` header), carried by its KV events.
    session_id: str | None = None
    #: ``vllm_xargs.kv_cache_report_mode == "full"``: re-announce the prefix-cache hit in the events.
    report_reused: bool = False
    #: Loop time the request arrived (set by the API); its parsing/tokenizing overlaps the modelled time.
    arrival: float | None = None
    # -- filled in by the engine --
    cached_tokens: int = 0
    local_hit_tokens: int = 0
    #: ``cached_tokens`` by tier: GPU prefix cache ("device"), CPU tier ("host"); remote = "p2p".
    device_tokens: int = 0
    host_tokens: int = 0
    remote_tokens: int = 0
    #: Prompt tokens this request wrote to the prefix cache (vLLM 0.33's ``num_cache_creation_tokens``).
    cache_created_tokens: int = 0
    output_tokens: int = 0
    kv_params_out: dict[str, Any] | None = None
    ttft_s: float = 0.0


@dataclass(slots=True)
class _Admission:
    hashes: list[BlockHash]
    usable: int
    total_blocks: int
    future: asyncio.Future[None]
    #: ``max_load_tokens`` in blocks: CPU-tier (and P2P) blocks loaded past the GPU prefix; None = no cap.
    max_load_blocks: int | None = None
    alloc: Allocation = field(default_factory=Allocation)
    n_gpu: int = 0
    #: Blocks after the GPU prefix that requests admitted before this one are computing (see :meth:`Engine.pump`).
    n_flight: int = 0
    n_cpu: int = 0
    queued: bool = False
    #: The admissions computing this one's in-flight blocks; it waits for them before its own prefill.
    waits_for: list[_Admission] = field(default_factory=list)
    #: Set once this request's computed blocks are in the cache (or it ended without them).
    stored: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    """One worker's scheduler and cache: every request goes through :meth:`generate`, which holds a slot
    and its blocks until it finishes (or is cancelled), so admission and KV space stay consistent."""

    def __init__(
        self,
        opts: WorkerOptions,
        emit: Callable[[KVEvent], None],
        client: P2PClient | None,
        *,
        engine_id: str,
        p2p_host: str,
        p2p_port: Callable[[], int],
        rank: int = 0,
        families: MetricFamilies | None = None,
    ) -> None:
        self.opts = opts
        self.preset = opts.preset
        self.rank = rank
        # vLLM keeps the plain hashes whenever a KV connector is configured: the CPU tier is one here.
        lookahead = opts.hash_lookahead_tokens if self.preset.cpu_blocks == 0 else 0
        self.cache = PagedCache(
            self.preset.gpu_blocks,
            self.preset.block_size,
            emit,
            cpu_blocks=self.preset.cpu_blocks,
            seed=opts.hash_seed,
            hash_bytes=opts.hash_bytes,
            self_describing=opts.self_describing_events,
            lookahead=lookahead,
            sliding_window=opts.hybrid_sliding_window,
            offload_ownership=opts.offload_ownership,
        )
        self.metrics = SimMetrics(
            opts.model_name,
            self.preset.block_size,
            self.preset.gpu_blocks,
            self.preset.cpu_blocks,
            running=lambda: self.running,
            waiting=lambda: self.waiting,
            usage=self.cache.usage,
            families=families,
            engine=rank,
        )
        self.transfers = Transfers(self, client)
        self.engine_id = engine_id
        self.p2p_host = p2p_host
        self._p2p_port = p2p_port
        self.pending: dict[BlockHash, int] = {}
        #: The first admitted request computing each pending block.
        self._computing: dict[BlockHash, _Admission] = {}
        self.running = 0
        self.decoding = 0
        self.recompute_decisions = 0
        self._queue: deque[_Admission] = deque()
        self._gpu_free_at = 0.0
        #: The prefills scheduled on this GPU, ``(start, end)`` in order. vLLM runs a worker's decodes in
        #: the same steps as its prefills, so a decode step that falls in one lasts until it ends: a
        #: prefill on a worker stalls every stream decoding there (what P/D disaggregation avoids).
        self._prefills: deque[tuple[float, float]] = deque()

    @property
    def waiting(self) -> int:
        """Requests not admitted yet (vllm:num_requests_waiting)."""
        return len(self._queue)

    # -- admission -----------------------------------------------------------------------------------

    def pump(self) -> None:
        """Admit waiting requests in arrival order while a sequence slot and KV space are free. With requests
        to schedule this is an engine step: it publishes a prefix-cache reset's ``AllBlocksCleared``."""
        if self._queue:
            self.cache.step()
        while self._queue and self.running < self.preset.max_num_seqs:
            adm = self._queue[0]
            if adm.future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            n_gpu, n_cpu = self.cache.match(adm.hashes[: adm.usable])
            if adm.max_load_blocks is not None:
                n_cpu = min(n_cpu, adm.max_load_blocks)
            if self.cache.swa is not None:  # a hybrid model: the sliding-window group must serve it too
                total = self.cache.hybrid_hit(adm.hashes, n_gpu + n_cpu)
                n_gpu, n_cpu = min(n_gpu, total), max(0, total - n_gpu)
            alloc = Allocation()
            self.cache.acquire(alloc, adm.hashes[:n_gpu])
            if not self.cache.reserve(alloc, adm.total_blocks - n_gpu):
                self.cache.release(alloc)
                return  # head of line waits for space (FCFS, as vLLM's scheduler)
            self._queue.popleft()
            n_flight = self._in_flight(adm, n_gpu) if not n_cpu and self.cache.swa is None else 0
            adm.alloc, adm.n_gpu, adm.n_flight, adm.n_cpu = alloc, n_gpu, n_flight, n_cpu
            self._mark(adm, adm.hashes[n_gpu + n_flight :])
            self.running += 1
            adm.future.set_result(None)

    def _in_flight(self, adm: _Admission, n_gpu: int) -> int:
        """How many blocks after the GPU prefix requests admitted earlier are computing now. vLLM puts a block
        in its prefix cache when it schedules the block, before the forward pass fills it, so a request admitted
        meanwhile reuses it (measured on vLLM 0.32: sent together with a request prefilling its 768-token prefix,
        a second request reports those 768 tokens cached). Its own prefill then runs after theirs."""
        n = 0
        computing = self._computing
        for h in adm.hashes[n_gpu : adm.usable]:
            owner = computing.get(h)
            if owner is None:
                break
            if owner not in adm.waits_for:
                adm.waits_for.append(owner)
            n += 1
        return n

    def _mark(self, adm: _Admission, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self.pending[h] = self.pending.get(h, 0) + 1
            self._computing.setdefault(h, adm)

    def _finish(self, alloc: Allocation) -> None:
        self.running -= 1
        self.cache.release(alloc)
        self.pump()

    # -- one request ---------------------------------------------------------------------------------

    def validate(self, req: EngineRequest) -> None:
        total = len(req.prompt) + req.max_tokens
        if not req.prompt:
            raise EngineError("The prompt is empty.")
        if total > self.preset.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {self.preset.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(req.prompt)} in the messages, "
                f"{req.max_tokens} in the completion). Please reduce the length."
            )
        if math.ceil(total / self.preset.block_size) > self.preset.gpu_blocks:
            raise EngineError(
                f"The request needs {total} tokens of KV cache; this worker holds only "
                f"{self.preset.gpu_blocks * self.preset.block_size}."
            )

    def _extras(self, req: EngineRequest, count: int) -> list[BlockExtra] | None:
        """Per-block extra keys of ``count`` blocks: None without a salt, else exactly ``count`` entries
        (the salt on block 0, as vLLM places it; none at all when the prompt has no full block)."""
        return request_extra_keys(count, cache_salt=req.cache_salt)

    async def generate(self, req: EngineRequest) -> AsyncGenerator[int, None]:
        """Run one request; yields the number of new output tokens each time some are produced."""
        self.validate(req)
        loop = asyncio.get_running_loop()
        t0 = req.arrival if req.arrival is not None else loop.time()
        bs = self.preset.block_size
        n_prompt = len(req.prompt)
        extras = self._extras(req, n_prompt // bs)
        hashes = self.cache.block_hashes(req.prompt, extras)
        lookahead = self.cache.lookahead_ids(req.prompt, len(hashes))
        usable = (n_prompt - 1) // bs  # vLLM always recomputes at least the last prompt token
        kv = req.kv
        # max_load_tokens belongs to the offloading connector (CPU tier, P2P), not to NIXL pulls.
        max_load = kv.max_load_tokens if kv is not None and not kv.is_nixl else None
        adm = _Admission(
            hashes,
            usable,
            math.ceil((n_prompt + req.max_tokens) / bs),
            loop.create_future(),
            max_load_blocks=None if max_load is None else max_load // bs,
        )
        self._queue.append(adm)
        self.pump()
        adm.queued = not adm.future.done()
        try:
            await adm.future
        except asyncio.CancelledError:
            if adm.future.done() and not adm.future.cancelled():
                self._unmark(hashes[adm.n_gpu + adm.n_flight :], adm)
                adm.stored.set()
                self._finish(adm.alloc)
            else:
                adm.future.cancel()
            raise
        alloc = adm.alloc
        hold = None
        computing = hashes[adm.n_gpu + adm.n_flight :]
        try:
            waited = await self._await_in_flight(adm)
            computing = hashes[adm.n_gpu + adm.n_flight :]  # what this request computes itself
            if kv is not None and kv.remote_decoder is not None:
                hold = self.transfers.open_hold("p2p", kv.remote_decoder.kv_request_id)
            if req.report_reused and adm.n_gpu:
                self.cache.report_reuse(
                    hashes[: adm.n_gpu],
                    req.prompt,
                    extras=extras,
                    session_id=req.session_id,
                    lookahead=lookahead,
                )
            local = adm.n_gpu + adm.n_flight + adm.n_cpu
            limit = usable if adm.max_load_blocks is None else min(usable, adm.n_gpu + adm.max_load_blocks)
            remote = await self.transfers.load(kv, hashes, local, limit)
            # The simulator's own CPU time (parsing, tokenizing, hashing) counts as part of the modelled
            # time, so TTFT stays faithful on a busy machine; a wait or a transfer starts the clock anew.
            remote_tried = kv is not None and (kv.remote_prefiller or kv.remote_kv_source or kv.nixl_remote)
            ready = loop.time() if (adm.queued or remote_tried or waited) else t0
            req.local_hit_tokens = local * bs
            req.device_tokens = (adm.n_gpu + adm.n_flight) * bs
            req.host_tokens = adm.n_cpu * bs
            req.remote_tokens = remote * bs
            req.cached_tokens = (local + remote) * bs
            # Counted at admission, as vLLM's scheduler stats: the per-tier split sums to cached_tokens.
            self.metrics.prefix_queries.inc(n_prompt)
            self.metrics.prefix_hits.inc(req.device_tokens)
            self.metrics.cache_hits(device=req.device_tokens, host=req.host_tokens, p2p=req.remote_tokens)
            max_offload = kv.max_offload_tokens if kv is not None else None
            offload_blocks = None if max_offload is None else max_offload // bs
            await self._prefill(req, adm, ready)
            self.cache.store(
                alloc,
                hashes[adm.n_gpu :],
                req.prompt[adm.n_gpu * bs : len(hashes) * bs],
                hashes[adm.n_gpu - 1] if adm.n_gpu else None,
                extras=extras[adm.n_gpu :] if extras is not None else None,
                offload_blocks=offload_blocks,
                first_index=adm.n_gpu,
                session_id=req.session_id,
                lookahead=lookahead[adm.n_gpu :] if lookahead is not None else None,
            )
            self._unmark(computing, adm)
            computing = []
            adm.stored.set()
            in_cache = sum(1 for h in hashes if h in self.cache.gpu)
            req.cache_created_tokens = max(0, min(in_cache * bs, n_prompt) - req.cached_tokens)
            self.metrics.prompt_done(
                total=n_prompt, local_hit=req.device_tokens, external=req.host_tokens + req.remote_tokens
            )
            req.ttft_s = loop.time() - t0
            self.metrics.ttft.observe(req.ttft_s)
            if hold is not None:
                self.transfers.fill_hold(hold, list(hashes), n_prompt, self.opts.kv_lease_s)
                hold = None
            req.output_tokens = 1
            yield 1
            async for produced in self._decode(req):
                yield produced
            self._store_output(req, alloc, hashes, offload_blocks)
            self._hand_over(req, hashes)
            self.metrics.generation_tokens.inc(req.output_tokens)
            self.metrics.e2e.observe(loop.time() - t0)
            self.metrics.success("length")
        finally:
            self._unmark(computing, adm)
            adm.stored.set()
            if hold is not None:  # failed before the blocks existed: nothing to keep
                self.transfers.drop_hold("p2p", hold.key, hold)
            self._finish(alloc)

    async def _prefill(self, req: EngineRequest, adm: _Admission, ready: float) -> None:
        """Wait for this request's turn on the worker's GPU timeline and its compute: promotion of the
        CPU-tier hits, then the uncached tokens (attention grows with the cached context)."""
        loop = asyncio.get_running_loop()
        cached = req.cached_tokens
        work = promote_seconds(self.preset, adm.n_cpu) + prefill_seconds(self.preset, len(req.prompt) - cached, cached)
        start = max(ready, self._gpu_free_at)
        end = start + self.opts.scaled(work)
        self._gpu_free_at = end
        if end > start:
            self._prefills.append((start, end))
        await asyncio.sleep(end - loop.time())
        if adm.n_cpu:
            self.cache.touch_cpu(adm.hashes[adm.n_gpu : adm.n_gpu + adm.n_cpu])
            self.metrics.promoted_blocks.inc(adm.n_cpu)

    def _unmark(self, hashes: list[BlockHash], adm: _Admission) -> None:
        for h in hashes:
            left = self.pending.get(h, 0) - 1
            if left > 0:
                self.pending[h] = left
            else:
                self.pending.pop(h, None)
            if self._computing.get(h) is adm:
                del self._computing[h]

    async def _await_in_flight(self, adm: _Admission) -> bool:
        """Wait until the requests computing ``adm``'s in-flight blocks have stored them; a block one of them
        did not store (it failed) is computed by ``adm`` itself. True if it had any to wait for."""
        if not adm.n_flight:
            return False
        for owner in adm.waits_for:
            await owner.stored.wait()
        start = adm.n_gpu
        gpu = self.cache.gpu
        there = 0
        for h in adm.hashes[start : start + adm.n_flight]:
            if h not in gpu:
                break
            there += 1
        if there < adm.n_flight:  # compute the rest here: it becomes this request's own work
            self._mark(adm, adm.hashes[start + there : start + adm.n_flight])
            adm.n_flight = there
        return True

    async def _decode(self, req: EngineRequest) -> AsyncGenerator[int, None]:
        chunk = self.opts.stream_chunk_s if req.stream else self.opts.batch_chunk_s
        loop = asyncio.get_running_loop()
        self.decoding += 1
        try:
            while req.output_tokens < req.max_tokens:
                now = loop.time()
                joined = self._prefill_ending(now)
                if joined is not None:  # this step is a prefill's too: its token comes when that ends
                    await asyncio.sleep(joined - now)
                    self.metrics.decode_stall.inc(joined - now)
                    req.output_tokens += 1
                    yield 1
                    continue
                step = self.opts.scaled(decode_step_seconds(self.preset, self.decoding))
                k = max(1, int(chunk / step)) if step > 0 else req.max_tokens
                k = min(k, req.max_tokens - req.output_tokens)
                await asyncio.sleep(step * k)
                req.output_tokens += k
                yield k
        finally:
            self.decoding -= 1

    def _prefill_ending(self, now: float) -> float | None:
        """The end of the prefill running on this GPU at ``now``, if one is."""
        prefills = self._prefills
        while prefills and prefills[0][1] <= now:
            prefills.popleft()
        if prefills and prefills[0][0] <= now:
            return prefills[0][1]
        return None

    def _store_output(
        self, req: EngineRequest, alloc: Allocation, hashes: list[BlockHash], offload_blocks: int | None
    ) -> None:
        """Cache the full blocks the answer completed (the last sampled token has no KV yet)."""
        bs = self.preset.block_size
        prompt_full = len(hashes) * bs
        # Every token so far (the last sampled one included: a lookahead hash may cover it), but only the
        # blocks whose KV exists, i.e. before the last sampled token.
        seq = req.prompt[prompt_full:] + output_token_ids(len(req.prompt), req.output_tokens)
        computed = len(seq) - 1
        if computed < bs:
            return
        parent = hashes[-1] if hashes else None
        extra = self._extras(req, 1) if not hashes else None
        new = self.cache.block_hashes(seq, extra, parent=parent, max_blocks=computed // bs)
        if not new:
            return
        self.cache.store(
            alloc,
            new,
            seq[: len(new) * bs],
            parent,
            extras=extra,
            offload_blocks=offload_blocks,
            first_index=len(hashes),
            session_id=req.session_id,
            lookahead=self.cache.lookahead_ids(seq, len(new)),
        )
        hashes.extend(new)

    def _hand_over(self, req: EngineRequest, hashes: list[BlockHash]) -> None:
        """NIXL roles after the answer: a prefiller keeps the prompt for its decoder (lease), a decoder
        keeps prompt + answer for the next turn (fixed TTL)."""
        kv = req.kv
        if kv is None:
            return
        bs = self.preset.block_size
        if kv.do_remote_decode:
            blocks = hashes[: len(req.prompt) // bs]
            hold = self.transfers.open_hold("nixl", req.request_id)
            self.transfers.fill_hold(hold, blocks, len(req.prompt), self.opts.kv_lease_s)
            req.kv_params_out = self._nixl_params(req.request_id, hold.block_ids, len(req.prompt))
            return
        if kv.do_remote_prefill and self.opts.bidirectional_kv_xfer:
            hold = self.transfers.open_hold("retain", req.request_id)
            num_tokens = len(req.prompt) + req.output_tokens
            self.transfers.fill_hold(hold, list(hashes), num_tokens, self.opts.decoder_kv_blocks_ttl)
            if not req.stream:
                req.kv_params_out = self._nixl_params(req.request_id, hold.block_ids, num_tokens)

    def _nixl_params(self, request_id: str, block_ids: list[int], num_tokens: int) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.p2p_host,
            "remote_port": self._p2p_port(),
            "remote_num_tokens": num_tokens,
            "tp_size": 1,
        }

    def reset_prefix_cache(self) -> bool:
        return self.cache.reset()

    def state(self) -> dict[str, Any]:
        """A debugging snapshot (``GET /sim/state``)."""
        return {
            "dp_rank": self.rank,
            "running": self.running,
            "waiting": len(self._queue),
            "decoding": self.decoding,
            "gpu_cached_blocks": len(self.cache.gpu),
            "gpu_free_cached_blocks": len(self.cache.lru),
            "cpu_blocks": len(self.cache.cpu),
            "reserved_blocks": self.cache.reserved,
            "kv_cache_usage": self.cache.usage(),
            "hash_seed": self.cache.seed,
            "holds": {kind: sorted(holds) for kind, holds in self.transfers.holds.items()},
            "recompute_decisions": self.recompute_decisions,
        }


async def drain(gen: AsyncGenerator[int, None]) -> None:
    """Consume a generation to the end (non-streaming answers); closed even when it fails, so its
    ``finally`` (slot, blocks, holds) runs now rather than at garbage collection."""
    try:
        async for _ in gen:
            pass
    finally:
        with contextlib.suppress(Exception):
            await gen.aclose()
