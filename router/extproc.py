"""The Endpoint Picker's ext_proc stream: one Envoy ``Process`` stream is one HTTP request.

Envoy sends the request headers, the body (in chunks until ``end_of_stream``), then the response headers
and body. The picker answers with the Gateway API Inference Extension's Endpoint Picker Protocol
(docs/proposals/004-endpoint-picker-protocol): the chosen worker as the ``x-gateway-destination-endpoint``
header *and* as dynamic metadata ``envoy.lb/x-gateway-destination-endpoint``, only among the endpoints of
the ``envoy.lb.subset_hint`` metadata when Envoy sends one, and an ImmediateResponse (OpenAI-style JSON
error) when the request cannot be routed.

The decision is the router's own: the same :class:`~kvroute.router.flow.RequestFlow` (tokens, index
lookup, policy) and the same body rewriting (client ``kv_transfer_params`` stripped, router-chosen ones
injected). Only single-leg plans can be carried out by one endpoint pick: workers with a prefill-only or
decode-only role are never candidates, so P/D plans (two legs) are not produced (docs/epp.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from kvroute.router.errors import ApiError, error_body
from kvroute.router.flow import DP_RANK_HEADER, Decision
from kvroute.router.forwarding import Result, UsageSniffer, usage_of
from kvroute.router.requests import GENERATION_ROUTES, new_request_id, parse_request
from kvroute.router.state import RouterState

log = logging.getLogger("kvroute.epp")

DESTINATION_KEY = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"

BodyMode = int
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
#: Request headers that describe the HTTP/2 exchange, not the request: never given to the flow.
_PSEUDO_OR_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade", "host"})


def endpoint_of(url: str) -> str:
    """A worker URL as the ``host:port`` the protocol speaks (IPv6 in brackets, scheme default port)."""
    parts = urlsplit(url)
    return _join(parts.hostname or "", _port(parts.scheme, parts.port))


def _port(scheme: str, port: int | None) -> int:
    return port or (443 if scheme == "https" else 80)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Endpoints:
    """Worker URL -> the ``ip:port`` Envoy knows the pod by. Envoy matches the pick against the pool's pod
    addresses, so a worker configured by DNS name (``vllm-0.vllm``) is reported by its resolved address;
    names are resolved in the background (:meth:`refresh`), never on the request path."""

    def __init__(self) -> None:
        self._resolved: dict[str, str] = {}

    def of(self, url: str) -> str:
        return self._resolved.get(url) or endpoint_of(url)

    async def refresh(self, urls: Iterable[str]) -> None:
        loop = asyncio.get_running_loop()
        fresh: dict[str, str] = {}
        for url in urls:
            parts = urlsplit(url)
            host = parts.hostname or ""
            if not host or _is_ip(host):
                continue
            try:
                async with asyncio.timeout(2.0):  # not wait_for: on 3.11 it can drop a cancellation
                    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except (OSError, TimeoutError) as exc:
                log.warning("cannot resolve worker %s (%s); reporting it by name", url, exc)
                continue
            if infos:
                fresh[url] = _join(str(infos[0][4][0]), _port(parts.scheme, parts.port))
        self._resolved = fresh


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _continue_headers() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def immediate(exc: ApiError, request_id: str) -> pb.ProcessingResponse:
    """The whole HTTP answer, sent by Envoy instead of calling any worker."""
    headers = pb.HeaderMutation(
        set_headers=[_header("content-type", "application/json"), _header("x-request-id", request_id)]
    )
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=exc.status),
            headers=headers,
            body=error_body(exc.status, exc.message, exc.code, exc.err_type),
            details=exc.code or "kvroute_epp",
        )
    )


@dataclass(slots=True)
class EppOptions:
    """What the picker assumes when Envoy does not say it (``protocol_config``) and how large a body can be."""

    body_mode: BodyMode = FULL_DUPLEX
    max_body_bytes: int = 32 * 1024 * 1024


@dataclass(slots=True)
class Pick:
    """A routed request: where it goes and the body it goes with."""

    decision: Decision
    worker_id: str
    endpoint: str
    body: bytes
    body_changed: bool


@dataclass(slots=True)
class Exchange:
    """The state of one ext_proc stream (one HTTP request and its answer)."""

    state: RouterState
    options: EppOptions
    endpoints: Endpoints
    request_mode: BodyMode = FULL_DUPLEX
    response_mode: BodyMode = FULL_DUPLEX
    headers: dict[str, str] = field(default_factory=dict)
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    subset: list[str] | None = None
    request_id: str = ""
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    pick: Pick | None = None
    began: float = field(default_factory=time.perf_counter)
    # response side
    status: int = 0
    sse: bool = False
    sniffer: UsageSniffer = field(default_factory=UsageSniffer)
    answer: list[bytes] = field(default_factory=list)
    ttfb_s: float | None = None
    served: str | None = None
    finished: bool = False

    # ------------------------------------------------------------------ dispatch

    async def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message from Envoy (none while a full-duplex body is still arriving)."""
        if msg.HasField("protocol_config"):
            self.request_mode = msg.protocol_config.request_body_mode
            self.response_mode = msg.protocol_config.response_body_mode
        if msg.HasField("metadata_context"):
            self._read_metadata(msg.metadata_context)
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(msg.request_headers)
        if kind == "request_body":
            return await self._request_body(msg.request_body)
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(msg.response_headers)
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "response_trailers":
            self.finish(ok=200 <= self.status < 400)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _read_metadata(self, metadata: base_pb2.Metadata) -> None:
        hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
        if hint is not None and SUBSET_KEY in hint.fields:
            value = hint.fields[SUBSET_KEY]
            if value.HasField("list_value"):
                self.subset = [v.string_value for v in value.list_value.values if v.string_value]
            else:  # a comma-separated string, as the destination header is
                self.subset = [s.strip() for s in value.string_value.split(",") if s.strip()]
        lb = metadata.filter_metadata.get(DESTINATION_NAMESPACE)
        if lb is not None and SERVED_KEY in lb.fields:
            self.served = lb.fields[SERVED_KEY].string_value or None

    # ------------------------------------------------------------------ request path

    async def _request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        for h in msg.headers.headers:
            value = h.raw_value.decode("latin-1") if h.raw_value else h.value
            key = h.key.lower()
            self.headers[key] = value
            if not key.startswith(":") and key not in _PSEUDO_OR_HOP:
                self.raw_headers.append((key.encode("latin-1"), value.encode("latin-1")))
        given = self.headers.get("x-request-id")
        self.request_id = given if given and _REQUEST_ID.match(given) else new_request_id()
        if msg.end_of_stream:  # no body (a GET): route on load alone
            return await self._route(b"", in_headers=True)
        if self.request_mode not in (FULL_DUPLEX, BUFFERED):
            mode = processing_mode_pb2.ProcessingMode.BodySendMode.Name(self.request_mode)
            return [
                immediate(
                    ApiError(
                        500,
                        f"kvroute epp needs request_body_mode FULL_DUPLEX_STREAMED or BUFFERED (Envoy sent {mode})",
                        "epp_misconfigured",
                    ),
                    self.request_id,
                )
            ]
        if self.request_mode == BUFFERED:
            return [_continue_headers()]  # Envoy waits for this before it sends the buffered body
        return []  # full duplex: the headers answer goes out with the body, once the pick is made

    async def _request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.size += len(msg.body)
        if self.size > self.options.max_body_bytes:
            return [
                immediate(
                    ApiError(
                        413,
                        f"request body is larger than the limit of {self.options.max_body_bytes} bytes",
                        "request_too_large",
                    ),
                    self.request_id,
                )
            ]
        self.chunks.append(msg.body)
        if not msg.end_of_stream:
            return []
        body = b"".join(self.chunks)
        self.chunks = []
        return await self._route(body, in_headers=False)

    async def _route(self, body: bytes, *, in_headers: bool) -> list[pb.ProcessingResponse]:
        try:
            pick = await self.choose(body)
        except ApiError as exc:
            self._count(exc.status, "-")
            return [immediate(exc, self.request_id)]
        except Exception:
            log.exception("request %s: the endpoint pick failed", self.request_id)
            self._count(500, "-")
            return [
                immediate(ApiError(500, "internal router error", "internal_error", "server_error"), self.request_id)
            ]
        self.pick = pick
        self.state.registry.acquire(pick.worker_id)
        meta = struct_pb2.Struct()
        meta.update({DESTINATION_NAMESPACE: {DESTINATION_KEY: pick.endpoint}})
        set_headers = [_header(DESTINATION_KEY, pick.endpoint), _header("x-request-id", self.request_id)]
        canonical = pick.decision.request.path
        if canonical != self.headers.get(":path"):  # what was checked is what Envoy forwards
            set_headers.append(_header(":path", canonical))
        rank = pick.decision.facts.ranks.get(pick.worker_id)
        if rank is not None:  # the data-parallel rank that holds the prefix
            set_headers.append(_header(DP_RANK_HEADER, str(rank)))
        if in_headers:
            common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers))
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)]
        if self.request_mode == FULL_DUPLEX or pick.body_changed:
            set_headers.append(_header("content-length", str(len(pick.body))))
        mutation = pb.HeaderMutation(set_headers=set_headers)
        if self.request_mode == FULL_DUPLEX:
            # Envoy forwards nothing of the body by itself in this mode: the picker sends it all back.
            body = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=pick.body, end_of_stream=True))
            return [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)),
                    dynamic_metadata=meta,
                ),
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=body))),
            ]
        common = pb.CommonResponse(header_mutation=mutation)
        if pick.body_changed:
            common.body_mutation.body = pick.body
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)]

    async def choose(self, body: bytes) -> Pick:
        """What ``kvroute serve`` does before it forwards, minus the forwarding: parse, decide, rewrite."""
        method = self.headers.get(":method", "POST")
        raw_path, _, query = self.headers.get(":path", "/").partition("?")
        request = parse_request(
            method,
            unquote(raw_path),
            self.raw_headers,
            body,
            client_kv_params=self.state.config.pool.client_kv_params,
            request_id=self.request_id,
            forward_headers=self.state.forwarded_headers,
            query=query,
        )
        flow = self.state.flow
        try:
            decision = await flow.decide(request, exclude=self._excluded())
        except ApiError as exc:
            split = [v.id for v in self.state.registry.views(request.model) if v.role != "both"]
            if exc.code == "no_healthy_worker" and split:
                raise ApiError(
                    503,
                    f"no worker can serve this request alone: {', '.join(sorted(split))} are "
                    "prefill/decode-only, and a prefill/decode split needs two legs, which one "
                    "endpoint pick cannot carry out (use kvroute serve for such pools)",
                    "unroutable_plan",
                ) from None
            raise
        if decision.plan.disaggregated:  # cannot happen with single-role candidates; refuse, never half-do it
            raise ApiError(
                503,
                "the routing plan needs two legs (prefill/decode), which one endpoint pick cannot carry out",
                "unroutable_plan",
            )
        delivery = flow.rewrite(decision)
        if not delivery.single_leg:
            raise ApiError(
                503, "the routing plan needs two legs, which one endpoint pick cannot carry out", "unroutable_plan"
            )
        worker = self.state.registry.get(delivery.worker_id)
        if worker is None:
            raise ApiError(503, f"worker {delivery.worker_id} left the pool", "no_healthy_worker")
        return Pick(
            decision, delivery.worker_id, self.endpoints.of(worker.url), delivery.body, delivery.body is not body
        )

    def _excluded(self) -> set[str]:
        """Workers this pick must not name: unable to serve a request alone (a prefill-only or decode-only
        role: their plans need two legs), or outside Envoy's subset hint."""
        allowed = set(self.subset) if self.subset is not None else None
        return {
            w.id
            for w in self.state.registry.all()
            if w.config.role != "both" or (allowed is not None and self.endpoints.of(w.url) not in allowed)
        }

    # ------------------------------------------------------------------ response path

    def _response_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        for h in msg.headers.headers:
            value = h.raw_value.decode("latin-1") if h.raw_value else h.value
            if h.key == ":status" and value.isdigit():
                self.status = int(value)
            elif h.key.lower() == "content-type":
                self.sse = value.startswith("text/event-stream")
        if self.pick is not None and not self.sse:
            self.ttfb_s = time.perf_counter() - self.pick.decision.request.started
        out = [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if msg.end_of_stream:
            self.finish(ok=200 <= self.status < 400)
        return out

    def _response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.sse:
            if self.ttfb_s is None and msg.body and self.pick is not None:  # a stream's first token
                self.ttfb_s = time.perf_counter() - self.pick.decision.request.started
            self.sniffer.feed(msg.body)
        elif sum(map(len, self.answer)) < self.options.max_body_bytes:
            self.answer.append(msg.body)
        if msg.end_of_stream:
            self.finish(ok=200 <= self.status < 400)
        if self.response_mode == FULL_DUPLEX:  # every chunk passes through the picker: hand it back untouched
            passed = pb.StreamedBodyResponse(body=msg.body, end_of_stream=msg.end_of_stream)
            return [
                pb.ProcessingResponse(
                    response_body=pb.BodyResponse(
                        response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=passed))
                    )
                )
            ]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def finish(self, *, ok: bool) -> None:
        """Once per request: free the worker's in-flight slot and report the outcome (cached tokens against
        the prediction) to the policy, as the HTTP router does after the last byte."""
        if self.finished or self.pick is None:
            return
        self.finished = True
        pick = self.pick
        self.state.registry.release(pick.worker_id)
        usage = self.sniffer.usage if self.sse else usage_of(b"".join(self.answer))
        worker_id = pick.worker_id
        if self.served and self.served != pick.endpoint:  # Envoy fell back to another endpoint
            worker_id = next(
                (w.id for w in self.state.registry.all() if self.endpoints.of(w.url) == self.served), worker_id
            )
        self.state.flow.report(pick.decision, Result(worker_id, self.status, self.ttfb_s, usage, ok))
        self._count(self.status or 499, pick.decision.request.model or "-")  # 499: no answer seen

    def _count(self, status: int, model: str) -> None:
        bare = self.headers.get(":path", "/").split("?", 1)[0]
        route = bare if bare in GENERATION_ROUTES else "other"
        self.state.metrics.observe_request(route, status, model, time.perf_counter() - self.began)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one :class:`Exchange` per stream."""

    def __init__(
        self, state: RouterState, options: EppOptions | None = None, endpoints: Endpoints | None = None
    ) -> None:
        self.state = state
        self.options = options or EppOptions()
        self.endpoints = endpoints or Endpoints()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],  # the gRPC method's name
        context: Any,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        mode = self.options.body_mode
        exchange = Exchange(self.state, self.options, self.endpoints, request_mode=mode, response_mode=mode)
        try:
            async for msg in request_iterator:
                answers: Iterable[pb.ProcessingResponse] = await exchange.handle(msg)
                for answer in answers:
                    yield answer
                    if answer.HasField("immediate_response"):
                        return  # Envoy answers the client itself; this stream is done
        finally:
            exchange.finish(ok=False)  # no-op when the answer was complete
