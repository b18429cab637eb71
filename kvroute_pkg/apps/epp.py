"""``kvroute epp``: the router as a Gateway API Inference Extension Endpoint Picker.

The same state as ``kvroute serve`` (:func:`~kvroute.apps.build.build_state`: registry with health and
metrics probes, KV index and event subscribers, policy, request flow) so ``/metrics``, ``/admin/*`` and
``/ready`` stay on the HTTP port; Envoy talks ext_proc gRPC to ``--grpc-port`` (9002, the port
InferencePool's ``endpointPickerRef`` conventionally names). The gRPC server is one of the state's
services, so both ports live and die together. The stream logic is in :mod:`kvroute.router.extproc`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvroute.apps.serve import add_common_arguments, run_router
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed

if TYPE_CHECKING:
    from kvroute.config import RouterConfig
    from kvroute.router.extproc import EppOptions
    from kvroute.router.state import RouterState

log = logging.getLogger("kvroute.epp")

DEFAULT_GRPC_PORT = 9002
#: gRPC health service names the Endpoint Picker Protocol defines, besides the overall "" status.
HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
HEALTH_INTERVAL_S = 1.0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "epp",
        help="run as a Gateway API Inference Extension Endpoint Picker (Envoy ext_proc)",
        description="Pick endpoints for Envoy (ext_proc gRPC on --grpc-port) with kvroute's index and policies; "
        "metrics, admin and readiness stay on the HTTP --port. See docs/epp.md.",
    )
    add_common_arguments(parser)
    parser.add_argument("--grpc-host", default=None, help="address of the ext_proc server (default: --host)")
    parser.add_argument(
        "--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help=f"ext_proc gRPC port (default {DEFAULT_GRPC_PORT})"
    )
    parser.add_argument(
        "--body-mode",
        choices=["full_duplex_streamed", "buffered"],
        default="full_duplex_streamed",
        help="Envoy's request/response body mode when its protocol_config does not say "
        "(default full_duplex_streamed, as the Inference Extension configures Envoy)",
    )
    parser.set_defaults(func=run)
    return parser


class GrpcEpp:
    """The ext_proc gRPC server (and its gRPC health service) over one router state: a state service."""

    def __init__(self, state: RouterState, host: str, port: int, options: EppOptions) -> None:
        self.state = state
        self.host = host
        #: The bound port once started (useful with port 0).
        self.port = port
        self.options = options
        self.server: Any = None
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
        from grpc_health.v1 import health_pb2_grpc
        from grpc_health.v1._async import HealthServicer
        from kvroute.router.extproc import Endpoints, ExternalProcessor

        state = self.state
        endpoints = Endpoints()
        await endpoints.refresh(w.url for w in state.registry.all())
        self.server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(state, self.options, endpoints), self.server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if not bound:
            raise RuntimeError(f"cannot bind the ext_proc server to {self.host}:{self.port}")
        self.port = bound
        await self.server.start()
        self._health_task = asyncio.create_task(self._maintain(health, endpoints), name="epp-maintain")
        log.info("ext_proc endpoint picker listening on %s:%d", self.host, self.port)

    async def _maintain(self, health: Any, endpoints: Any) -> None:
        """gRPC health mirrors ``/ready`` (:meth:`RouterState.readiness`: every model has a healthy worker and
        the index has caught up), and worker names are re-resolved (pods get new addresses when they restart)."""
        from grpc_health.v1 import health_pb2

        state = self.state
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        await health.set("liveness", serving)
        while True:
            raise_if_cancel_swallowed()
            ok = state.readiness()["ready"]
            for name in HEALTH_SERVICES:
                if name != "liveness":
                    await health.set(name, serving if ok else not_serving)
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await endpoints.refresh(w.url for w in state.registry.all())
            except Exception:
                log.exception("resolving worker addresses failed")

    async def stop(self) -> None:
        if self._health_task is not None:
            await cancel_and_wait([self._health_task])  # bounded, even if an await dropped the cancel
        if self.server is not None:
            await self.server.stop(grace=2.0)  # in-flight streams get a moment to finish


def epp_service(
    *,
    host: str,
    port: int = DEFAULT_GRPC_PORT,
    body_mode: str = "full_duplex_streamed",
    max_body_bytes: int | None = None,
) -> Callable[[RouterState], GrpcEpp]:
    """The EPP as a service of the router state (for ``build_app(extra_services=...)``)."""
    from kvroute.router.extproc import BUFFERED, FULL_DUPLEX, EppOptions

    def make(state: RouterState) -> GrpcEpp:
        options = EppOptions(
            body_mode=BUFFERED if body_mode == "buffered" else FULL_DUPLEX,
            max_body_bytes=max_body_bytes or state.config.max_body_bytes,
        )
        return GrpcEpp(state, host, port, options)

    return make


def run(args: argparse.Namespace) -> int:
    def services(config: RouterConfig) -> list[Callable[[RouterState], GrpcEpp]]:
        return [epp_service(host=args.grpc_host or config.host, port=args.grpc_port, body_mode=args.body_mode)]

    # The asyncio loop, not uvloop: grpc.aio integrates with the standard event loop.
    return run_router(args, "kvroute epp", loop="asyncio", extra_services=services)
