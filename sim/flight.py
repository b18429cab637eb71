"""One admitted generation's life: admission control, the data-parallel rank, the engine's output
counts, and the release of its admission ticket and rank slot however it ends (streamed, failed, closed
or dropped unread). :class:`GenerationHandlers` is the base of every generating route class."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING

from kvroute.sim.engine import EngineError, EngineRequest
from kvroute.sim.errors import ApiError
from kvroute.sim.http_common import DP_RANK_HEADER
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

if TYPE_CHECKING:
    from kvroute.sim.admission import Ticket
    from kvroute.sim.worker import SimRank, SimWorker


class Flight:
    """One admitted generation: its admission ticket and its rank's in-flight count, released once."""

    __slots__ = ("done", "rank", "ticket")

    def __init__(self, rank: SimRank, ticket: Ticket) -> None:
        self.rank, self.ticket, self.done = rank, ticket, False
        rank.inflight += 1

    def first_token(self) -> None:
        self.ticket.first_token()

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.ticket.release()
            self.rank.inflight -= 1


class StreamBody:
    """A streaming body that gives its flight back when it ends, fails, is closed, or is dropped unread
    (a client gone before the first chunk: Starlette never starts the generator, whose ``finally`` would
    then never run)."""

    def __init__(self, gen: AsyncGenerator[bytes, None], release: Callable[[], None]) -> None:
        self._gen, self._release = gen, release

    def __aiter__(self) -> StreamBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._gen.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        self._release()
        await self._gen.aclose()

    def __del__(self) -> None:
        self._release()


class GenerationHandlers:
    """Route handlers bound to one worker that run generations: admission, rank, engine, release."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    # -- admission, rank, engine ------------------------------------------------------------------------

    def _rank(self, request: Request) -> SimRank:
        """vLLM's ``_get_data_parallel_rank`` + ``process_inputs``: a header that is not an integer is
        ignored, one out of ``[0, dp_size)`` is a 400; no header = the load balancer's choice."""
        worker = self.worker
        raw = request.headers.get(DP_RANK_HEADER)
        rank: int | None = None
        if raw is not None:
            try:
                rank = int(raw)
            except ValueError:
                rank = None
        if rank is not None:
            if not 0 <= rank < worker.dp_size:
                raise ApiError(400, f"data_parallel_rank {rank} is out of range [0, {worker.dp_size}).")
            return worker.ranks[rank]
        return worker.ranks[worker.balance() if worker.dp_size > 1 else 0]

    def _admit(self, request: Request, req: EngineRequest) -> Flight:
        """Admission control (503), the engine's own checks (400), the rank (400): raised before anything
        is sent, in vLLM's order; then the request counts until its flight is released."""
        worker = self.worker
        worker.admission.check()
        try:
            worker.engine.validate(req)  # every rank runs the same model and cache size
        except EngineError as exc:
            raise ApiError(400, str(exc)) from None
        rank = self._rank(request)
        return Flight(rank, worker.admission.admit(len(req.prompt)))

    async def _tokens(self, flight: Flight, req: EngineRequest) -> AsyncGenerator[int, None]:
        """The engine's output counts; marks the end of prefill and releases the flight at the end."""
        gen = flight.rank.engine.generate(req)
        try:
            async for produced in gen:
                flight.first_token()
                yield produced
        finally:
            flight.release()
            await gen.aclose()

    async def _run(self, flight: Flight, req: EngineRequest) -> None:
        """A non-streaming generation to its end (closed even when it fails: slot, blocks, flight)."""
        tokens = self._tokens(flight, req)
        try:
            async for _ in tokens:
                pass
        finally:
            await tokens.aclose()

    def _streaming(self, flight: Flight, gen: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> Response:
        return StreamingResponse(StreamBody(gen, flight.release), media_type="text/event-stream", headers=headers)
