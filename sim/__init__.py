"""Simulated vLLM workers ("digital twin"): the OpenAI API, KV events over ZMQ, a paged KV cache, a timing model.

A separate program: it shares only the wire formats (``kvroute.indexer.events`` / ``keys``) and the bottom
layer (``kvroute.vocabulary``) with the rest of kvroute, never the router or the policies, so it behaves
like the real engine and not like what the router expects.

Modules:

- ``fleet`` — :class:`SimFleet`, N workers in one loop, and the ``kvroute serve`` config for them
- ``worker`` — :class:`SimWorker`: HTTP server, KV-event publishers, replay and P2P sockets of one worker
  (one :class:`~kvroute.sim.worker.SimRank` per data-parallel rank)
- ``options`` — :class:`WorkerOptions`, everything a worker can be told
- ``api`` — vLLM's HTTP surface (completions, chat, ``/kv_event_sources``, ...) and its error shapes;
  ``surfaces`` — the Anthropic Messages, OpenAI Responses and render shapes; ``errors`` — error bodies
- ``admission`` — vLLM's ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` (HTTP 503)
- ``engine`` — admission, prefill/decode timeline, KV-transfer hooks of one request
- ``kvcache`` — the paged prefix cache (chain hashes, LRU, lookahead hashing, a hybrid model's
  sliding-window group) emitting vLLM KV events; ``offload_tier`` — its CPU tier; ``events`` — their
  types and 0.33 encoding
- ``publisher`` — ZMQ PUB + replay ROUTER exactly as vLLM publishes
- ``kvparams`` — ``kv_transfer_params`` validation; ``transfers`` / ``p2p`` — moving KV between workers
- ``timing`` / ``presets`` — the timing model and the model x hardware figures
- ``tokenizer`` / ``output`` — the built-in tokenizer and the deterministic generated text
- ``traces`` / ``replay`` — seeded workloads and the client that replays them

``SimFleet`` and friends are imported lazily so ``kvroute.sim.tokenizer`` stays importable without
loading the servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvroute.sim.fleet import SimFleet
    from kvroute.sim.options import WorkerOptions
    from kvroute.sim.presets import get_preset
    from kvroute.sim.worker import SimWorker

__all__ = ["SimFleet", "SimWorker", "WorkerOptions", "get_preset"]


def __getattr__(name: str) -> object:
    if name == "SimFleet":
        from kvroute.sim.fleet import SimFleet

        return SimFleet
    if name == "SimWorker":
        from kvroute.sim.worker import SimWorker

        return SimWorker
    if name == "WorkerOptions":
        from kvroute.sim.options import WorkerOptions

        return WorkerOptions
    if name == "get_preset":
        from kvroute.sim.presets import get_preset

        return get_preset
    raise AttributeError(name)
