"""Control and introspection routes of one worker: models, health, version, tokenize, Prometheus
metrics, prefix-cache reset, KV-event discovery (``/kv_event_sources``) and the sim's own ``/sim/*``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.sim.errors import ApiError
from kvroute.sim.http_common import PROMETHEUS_TYPE, error_response, json_response, read_body
from starlette.requests import Request
from starlette.responses import Response

if TYPE_CHECKING:
    from kvroute.sim.worker import SimWorker


class ControlHandlers:
    """The control and introspection routes bound to one worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    async def models(self, request: Request) -> Response:
        worker = self.worker
        card = {
            "id": worker.model,
            "object": "model",
            "created": worker.created,
            "owned_by": "vllm",
            "root": worker.model,
            "parent": None,
            "max_model_len": worker.opts.preset.max_model_len,
            "permission": [],
        }
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.worker.healthy:
            return Response(status_code=200)
        return error_response(503, "The engine is not healthy.", "ServiceUnavailableError")

    async def kv_event_sources(self, request: Request) -> Response:
        """vLLM 0.32/0.33's discovery route as released (``serve/instrumentator/basic.py``): the engine client's
        ``dict[int, KVEventsConfig]``, JSON-encoded as rank -> the rank's resolved publisher config."""
        sources = sorted(self.worker.kv_event_sources(), key=lambda s: s["data_parallel_rank"])
        return json_response(
            {
                str(s["data_parallel_rank"]): {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": s["endpoint"],
                    "replay_endpoint": s["replay_endpoint"],
                    "buffer_steps": 10_000,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": s["topic"],
                }
                for s in sources
            }
        )

    async def tokenize(self, request: Request) -> Response:
        worker = self.worker
        try:
            body = await read_body(request)
            model = body.get("model")
            if model is not None and model != worker.model:
                raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list):
                    raise ApiError(400, "messages must be a list.", param="messages")
                try:
                    gen_prompt = bool(body.get("add_generation_prompt", True))
                    tokens = worker.tokenizer.encode_chat(messages, gen_prompt)
                except (ValueError, TypeError) as exc:
                    raise ApiError(400, str(exc), param="messages") from None
            elif isinstance(body.get("prompt"), str):
                tokens = worker.tokenizer.encode(body["prompt"])
            else:
                raise ApiError(400, "Either prompt (a string) or messages is required.")
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.param)
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": worker.opts.preset.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(self.worker.engine.metrics.render(), media_type=PROMETHEUS_TYPE)

    async def reset_prefix_cache(self, request: Request) -> Response:
        if not all([r.engine.reset_prefix_cache() for r in self.worker.ranks]):  # vLLM resets every rank
            return error_response(
                409, "Failed to reset prefix cache: blocks are in use by running requests.", "ConflictError"
            )
        return Response(status_code=200)

    async def state(self, request: Request) -> Response:
        worker = self.worker
        state = {**worker.engine.state(), **worker.describe()}
        if worker.dp_size > 1:
            state["ranks"] = [r.engine.state() for r in worker.ranks]
        return json_response(state)

    async def set_health(self, request: Request) -> Response:
        try:
            body = await read_body(request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.type)
        healthy = body.get("healthy")
        if not isinstance(healthy, bool):
            return error_response(400, "healthy must be a boolean.", param="healthy")
        self.worker.healthy = healthy
        return json_response({"healthy": healthy})

    async def version(self, request: Request) -> Response:
        return json_response({"version": "0.11.0+kvroute-sim"})
