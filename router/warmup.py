"""Load at startup what the first request would otherwise wait for.

A router that has just started answers its first request several milliseconds late, or hundreds on a real
tokenizer: the model's tokenizer is loaded on first use (a ``tokenizer.json`` parsed, a plugin imported),
and anyio imports its event-loop backend the first time the forwarder opens a cancel scope. Both happen
here instead, before the app reports ready; a tokenizer that fails to load is logged, and its requests route
without the index as they would have anyway.
"""

from __future__ import annotations

import logging

import anyio
from kvroute.router.tokens import Tokenizers

log = logging.getLogger("kvroute.warmup")


class WarmUp:
    """A :class:`~kvroute.router.state.Service` that preloads the configured tokenizers and anyio's backend."""

    def __init__(self, tokenizers: Tokenizers) -> None:
        self.tokenizers = tokenizers

    async def start(self) -> None:
        with anyio.CancelScope():  # imports anyio's asyncio backend, as the forwarder's first stream would
            pass
        await preload_tokenizers(self.tokenizers)

    async def stop(self) -> None:
        return None


async def preload_tokenizers(tokenizers: Tokenizers, models: list[str] | None = None) -> None:
    """Load ``models``' tokenizers (default: every configured one), logging the ones that fail."""
    for model, why in (await tokenizers.preload(models)).items():
        log.warning("tokenizer of %s did not load (%s): its requests route without the index", model, why)
