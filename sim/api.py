"""The HTTP API of one simulated worker, shaped like vLLM 0.32-0.33's (Starlette, no FastAPI: it is
lighter, and 16 workers share one process): OpenAI completions and chat, the Anthropic Messages API,
the OpenAI Responses API (:mod:`kvroute.sim.surfaces`), the scale-out render routes, tokenize, metrics,
discovery. Every generation surface goes through the same admission control, data-parallel rank
choice and engine, so one conversation hits the same KV cache whichever surface carries it.

Every error is vLLM's OpenAI-style JSON body with the status it uses: bad input is a 4xx raised before
anything is sent, an unknown path or method is the HTTP status in that shape, and a fault inside the sim
is a JSON 500 (non-streaming) or, once a stream has started, vLLM's in-band ``data: {"error": ...}``
event followed by ``data: [DONE]``; a client never sees a plain-text error or a cut stream.

The routes' handlers live by job: :mod:`kvroute.sim.openai_api` (completions, chat),
:mod:`kvroute.sim.surface_api` (Messages, Responses), :mod:`kvroute.sim.render_api` (scale-out render),
:mod:`kvroute.sim.control_api` (health, metrics, tokenize, discovery, sim state), on the shared
:mod:`kvroute.sim.http_common` (bodies, fields, errors) and :mod:`kvroute.sim.flight` (admission, rank,
engine, release). This module builds the app and answers routing errors and unhandled faults.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

from kvroute.sim.control_api import ControlHandlers
from kvroute.sim.errors import ApiError, error_body
from kvroute.sim.http_common import error_response, internal_message, log
from kvroute.sim.openai_api import OpenAIHandlers
from kvroute.sim.render_api import RenderHandlers
from kvroute.sim.surface_api import MessagesHandlers, ResponsesHandlers
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker

__all__ = ["ApiError", "OpenAIHandlers", "build_app", "error_body", "error_response"]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path 404, wrong method 405) in the JSON shape, typed by the HTTP phrase as
    vLLM's handler does, instead of Starlette's plain text."""
    if not isinstance(exc, HTTPException):
        return await _server_error(request, exc)
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "Error"
    return error_response(exc.status_code, str(exc.detail), phrase, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """Last resort for a fault the handlers did not catch: a JSON 500, never Starlette's plain text."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, internal_message(exc), "InternalServerError")


def build_app(worker: SimWorker) -> Starlette:
    h = OpenAIHandlers(worker)
    m, r = MessagesHandlers(worker), ResponsesHandlers(worker)
    x, c = RenderHandlers(worker), ControlHandlers(worker)
    return Starlette(
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
        routes=[
            Route("/v1/completions", h.completions, methods=["POST"]),
            Route("/v1/chat/completions", h.chat, methods=["POST"]),
            Route("/v1/messages", m.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", m.count_tokens, methods=["POST"]),
            Route("/v1/responses", r.responses, methods=["POST"]),
            Route("/v1/completions/render", x.render_completions, methods=["POST"]),
            Route("/v1/chat/completions/render", x.render_chat, methods=["POST"]),
            Route("/v1/messages/render", x.render_messages, methods=["POST"]),
            Route("/v1/responses/render", x.render_responses, methods=["POST"]),
            Route("/v1/models", c.models, methods=["GET"]),
            Route("/health", c.health, methods=["GET"]),
            Route("/tokenize", c.tokenize, methods=["POST"]),
            Route("/metrics", c.metrics, methods=["GET"]),
            Route("/version", c.version, methods=["GET"]),
            Route("/reset_prefix_cache", c.reset_prefix_cache, methods=["POST"]),
            Route("/kv_event_sources", c.kv_event_sources, methods=["GET"]),
            Route("/sim/state", c.state, methods=["GET"]),
            Route("/sim/health", c.set_health, methods=["POST"]),
        ],
    )
