"""Upstream HTTP clients behind one small interface, so the hot path can use httpx or aiohttp.

Both clients are pooled (one per app), send raw bytes and hand back raw bytes (no decompression), so
what the worker sends is what the client gets. Failures are mapped to :class:`UpstreamError` with a
``kind`` the forwarder uses to decide between a retry on another worker, a 502 and a 504.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Literal

import httpx

if TYPE_CHECKING:
    import aiohttp

ErrorKind = Literal["connect", "timeout", "protocol", "rejected", "stalled"]


class UpstreamError(Exception):
    """An upstream call failed. ``connect``/``protocol`` before any byte reached the client can be retried."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamResponse(ABC):
    """A response whose headers arrived; the body is read with :meth:`chunks` or :meth:`read`."""

    status: int
    headers: list[tuple[str, str]]

    @abstractmethod
    def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives, byte for byte."""

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    @abstractmethod
    async def aclose(self) -> None:
        """Release the connection; before the end of the body this aborts the upstream request."""


class Transport(ABC):
    """A pooled client for all workers."""

    name: str = "abstract"

    @abstractmethod
    async def request(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> UpstreamResponse:
        """Send a request and wait for the response headers. Raises UpstreamError."""

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """A small GET (probes, scrapes, model lists) with its own overall timeout."""
        async with asyncio.timeout(timeout):
            resp = await self.request("GET", url, [("accept-encoding", "identity")], b"")
            try:
                return resp.status, await resp.read()
            finally:
                await resp.aclose()

    @abstractmethod
    async def aclose(self) -> None: ...


# ---------------------------------------------------------------------------------------------- httpx


class _HttpxResponse(UpstreamResponse):
    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = resp.headers.multi_items()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamError("timeout", f"upstream read timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError("protocol", f"upstream broke the response: {exc!r}") from exc

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        except httpx.TimeoutException as exc:
            raise UpstreamError("timeout", f"upstream read timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError("protocol", f"upstream broke the response: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._resp.aclose()


class HttpxTransport(Transport):
    name = "httpx"

    def __init__(self, connect_timeout: float, read_timeout: float, max_connections: int = 1024) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=read_timeout, write=read_timeout, pool=connect_timeout),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=30.0
            ),
            follow_redirects=False,
            trust_env=False,
        )

    async def request(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> UpstreamResponse:
        req = self._client.build_request(method, url, headers=headers, content=body)
        try:
            resp = await self._client.send(req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise UpstreamError("connect", f"cannot connect to {url}: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise UpstreamError("timeout", f"{url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError("protocol", f"{url} failed before answering: {exc!r}") from exc
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        await self._client.aclose()


# -------------------------------------------------------------------------------------------- aiohttp


class _AiohttpResponse(UpstreamResponse):
    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = list(resp.headers.items())

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        import aiohttp

        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except TimeoutError as exc:
            raise UpstreamError("timeout", "upstream read timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError("protocol", f"upstream broke the response: {exc!r}") from exc

    async def read(self) -> bytes:
        import aiohttp

        try:
            return await self._resp.read()
        except TimeoutError as exc:
            raise UpstreamError("timeout", "upstream read timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError("protocol", f"upstream broke the response: {exc!r}") from exc

    async def aclose(self) -> None:
        # close(), not release(): release() would drain an unfinished body instead of aborting it.
        self._resp.close()


class AiohttpTransport(Transport):
    """aiohttp (optional dependency): measured against httpx by bench/proxy_overhead.py."""

    name = "aiohttp"

    def __init__(self, connect_timeout: float, read_timeout: float, max_connections: int = 1024) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
        self._max = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _ensure(self) -> aiohttp.ClientSession:
        # Created lazily: a ClientSession must be born inside the running loop.
        if self._session is None:
            connector = self._aiohttp.TCPConnector(limit=self._max, limit_per_host=0, keepalive_timeout=30.0)
            self._session = self._aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def request(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes) -> UpstreamResponse:
        aiohttp = self._aiohttp
        session = self._ensure()
        try:
            resp = await session.request(
                method,
                url,
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError("connect", f"cannot connect to {url}: {exc!r}") from exc
        except TimeoutError as exc:
            raise UpstreamError("timeout", f"{url} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError("protocol", f"{url} failed before answering: {exc!r}") from exc
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def make_transport(kind: str, connect_timeout: float, read_timeout: float) -> Transport:
    """``auto`` is kvroute's own client (:mod:`kvroute.router.native_http`): per request it measured
    several times cheaper than aiohttp, itself several times cheaper than httpx (bench/proxy_overhead.py,
    docs/benchmarks.md). ``aiohttp`` and ``httpx`` stay selectable."""
    if kind in ("auto", "native"):
        from kvroute.router.native_http import NativeTransport

        return NativeTransport(connect_timeout, read_timeout)
    if kind == "httpx":
        return HttpxTransport(connect_timeout, read_timeout)
    if kind == "aiohttp":
        return AiohttpTransport(connect_timeout, read_timeout)
    raise ValueError(f"unknown http client {kind!r} (native, aiohttp or httpx)")
