"""``kvroute serve``: the router's command line. Flags override the config file and KVROUTE_* variables."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.config import RouterConfig
    from kvroute.router.state import RouterState, Service

_LOG_LEVELS = {"critical", "error", "warning", "info", "debug", "trace"}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible router",
        description="Run the router. The simplest start: kvroute serve --worker http://127.0.0.1:8100 "
        "--worker http://127.0.0.1:8101 (models discovered from each worker's /v1/models).",
    )
    add_common_arguments(parser)
    parser.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="serving processes sharing the port (default 1; see docs/design-notes.md, Serving across cores)",
    )
    parser.set_defaults(func=run)
    return parser


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``kvroute serve`` and ``kvroute epp`` share (both run the same router state)."""
    parser.add_argument("--config", metavar="FILE", help="YAML config file (default: $KVROUTE_CONFIG)")
    parser.add_argument(
        "--worker",
        metavar="URL",
        action="append",
        default=None,
        help="worker base URL (repeatable); replaces the config file's worker list",
    )
    parser.add_argument(
        "--policy", help="routing policy by name (default kvaware; round_robin, least_load, prefix, ...)"
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000)")
    parser.add_argument("--admin-token", help="bearer token required by /admin (default: none)")
    parser.add_argument("--http-client", choices=["auto", "native", "aiohttp", "httpx"], help="upstream HTTP client")
    parser.add_argument("--max-body-bytes", type=int, help="largest accepted request body")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    parser.add_argument("--check", action="store_true", help="validate the configuration and exit")


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """CLI flags as config overrides (None = not given)."""
    return {
        "workers": [{"url": url} for url in args.worker] if args.worker else None,
        "policy": args.policy,
        "host": args.host,
        "port": args.port,
        "admin_token": args.admin_token,
        "http_client": args.http_client,
        "max_body_bytes": args.max_body_bytes,
        "log_level": args.log_level,
        "processes": getattr(args, "processes", None),  # kvroute serve only
    }


def load_checked(args: argparse.Namespace, prog: str, overrides: dict[str, Any] | None = None) -> RouterConfig | int:
    """The validated RouterConfig (flags as overrides unless ``overrides`` are given), or an exit code
    (2: invalid) after printing why."""
    from kvroute.config import ConfigError, load_config

    try:
        config = load_config(args.config, overrides_from(args) if overrides is None else overrides)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    from kvroute.policies import available_policies

    if config.policy not in available_policies():
        print(
            f"{prog}: invalid configuration: policy: unknown policy {config.policy!r}; "
            f"available: {', '.join(available_policies())}",
            file=sys.stderr,
        )
        return 2
    if config.log_level.lower() not in _LOG_LEVELS:
        print(
            f"{prog}: invalid configuration: log_level: {config.log_level!r} is not one of "
            f"{', '.join(sorted(_LOG_LEVELS))}",
            file=sys.stderr,
        )
        return 2
    if not config.workers:
        print(
            f"{prog}: no workers configured (use --worker URL or a config file); "
            "workers can also be added later with POST /admin/workers",
            file=sys.stderr,
        )
    return config


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level="DEBUG" if level == "trace" else level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run(args: argparse.Namespace) -> int:
    return run_router(args, "kvroute serve")


def run_router(
    args: argparse.Namespace,
    prog: str,
    *,
    loop: str = "uvloop",
    extra_services: Callable[[RouterConfig], Sequence[Callable[[RouterState], Service]]] | None = None,
) -> int:
    """Validate the config, build the router app (with the services ``extra_services(config)`` names: the
    EPP's gRPC server), and serve it until stopped. Shared by ``kvroute serve`` and ``kvroute epp``.
    With ``processes`` > 1 this process supervises that many serving processes (:mod:`kvroute.apps.prefork`);
    each of them comes back here as a child (:mod:`kvroute.apps.serving_process`)."""
    from kvroute.apps.prefork import ChildSpec, refusal

    child = ChildSpec.from_env()
    overrides = child.overrides if child is not None else overrides_from(args)
    config = load_checked(args, prog, overrides)
    if isinstance(config, int):
        return config
    problem = refusal(config, serve=extra_services is None) if child is None else None
    if problem:
        print(f"{prog}: invalid configuration: processes: {problem}", file=sys.stderr)
        return 2
    if args.check:
        print(config.model_dump_json(indent=2, exclude={"admin_token"}))
        return 0

    level = config.log_level.lower()
    setup_logging(level)
    path = args.config or os.environ.get("KVROUTE_CONFIG")
    if config.processes > 1 and child is None:
        from kvroute.apps.prefork import supervise

        return supervise(config, args.config, overrides, path)

    import uvicorn
    from kvroute.apps.build import build_app
    from kvroute.apps.http_protocol import guarded_protocol

    services = list(extra_services(config)) if extra_services else []
    if path:  # SIGHUP or a change of the file reloads it (kvroute.apps.reload)
        from kvroute.apps.reload import ConfigReloader

        services.append(lambda state: ConfigReloader(state, path, overrides))
    admin: list[Any] = []
    if child is not None:
        from kvroute.apps.serving_process import ParentWatch, process_router

        services.append(lambda state: ParentWatch(child.parent_pid))
        admin.append(process_router(child))
    try:
        app = build_app(config, extra_services=services, admin_routers=admin)
    except (KeyError, TypeError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {
        "loop": loop,
        "http": guarded_protocol(config.header_timeout_s, config.max_connections),
        "log_level": level,
        "access_log": False,
        "server_header": False,
        "proxy_headers": False,
    }
    if child is not None:
        from kvroute.apps.serving_process import serve_on_shared_port

        return serve_on_shared_port(app, config.host, config.port, **options)
    uvicorn.run(app, host=config.host, port=config.port, **options)
    return 0
