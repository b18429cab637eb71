"""Fixtures for the Endpoint Picker: the full router state (build_app) with its ext_proc gRPC server, and a
small Envoy stand-in that speaks ext_proc over a real gRPC stream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from kvroute.apps.build import build_app
from kvroute.apps.epp import GrpcEpp, epp_service
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.http.upstream import serve

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


@dataclass
class Picker:
    """A running picker: its HTTP base URL (metrics, admin), the app, and a stub on its gRPC port."""

    url: str
    app: Any
    stub: pb_grpc.ExternalProcessorStub


@contextlib.asynccontextmanager
async def running_epp(config: dict[str, Any], body_mode: str = "full_duplex_streamed") -> AsyncIterator[Picker]:
    app = build_app(
        RouterConfig.model_validate(config),
        extra_services=[epp_service(host="127.0.0.1", port=0, body_mode=body_mode)],
    )
    epp = next(s for s in app.state.kvroute.services if isinstance(s, GrpcEpp))
    async with serve(app, lifespan="on") as url, grpc.aio.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        yield Picker(url, app, pb_grpc.ExternalProcessorStub(channel))


@contextlib.asynccontextmanager
async def epp_fleet(n: int = 2, **router: Any) -> AsyncIterator[tuple[SimFleet, Picker]]:
    """A simulated fleet and the picker in front of it (as `kvroute epp` would run)."""
    fleet = SimFleet(n, "tiny", time_scale=0.01)
    async with fleet:
        config = fleet.serve_config(policy="kvaware", health_interval_s=0.2, metrics_interval_s=0.2, **router)
        async with running_epp(config) as picker:
            yield fleet, picker


def header_map(pairs: Sequence[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def request_headers(
    path: str = "/v1/completions",
    *,
    mode: int | None = FULL_DUPLEX,
    eos: bool = False,
    subset: list[str] | None = None,
    method: str = "POST",
) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=header_map(
                [(":method", method), (":path", path), (":authority", "gw"), ("content-type", "application/json")]
            ),
            end_of_stream=eos,
        )
    )
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def request_body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=eos))


def response_headers(status: int, content_type: str = "application/json") -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map([(":status", str(status)), ("content-type", content_type)]))
    )


def response_body(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=eos))


class Envoy:
    """Drives one ext_proc stream as Envoy does: write messages, read the picker's answers."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub) -> None:
        self.call = stub.Process()

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for msg in messages:
            await self.call.write(msg)

    async def recv(self, n: int = 1) -> list[pb.ProcessingResponse]:
        out = []
        for _ in range(n):
            answer = await self.call.read()
            assert answer is not grpc.aio.EOF, "the picker ended the stream early"
            out.append(answer)
        return out

    async def close(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key.lower(): (h.header.raw_value.decode() or h.header.value) for h in mutation.set_headers}


def picked_metadata(answer: pb.ProcessingResponse) -> str:
    return answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value
