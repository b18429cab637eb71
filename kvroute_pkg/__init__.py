"""kvroute: a KV-cache-aware router for vLLM worker pools.

Layers, each importing only the ones below it:

* ``kvroute.apps`` — the processes (serve, epp, indexer, sim, demo, the CLI dispatcher) and the one
  composition root (``kvroute.apps.build``) that builds every part from the config, once, in order;
* ``kvroute.router`` — HTTP, the request flow, forwarding, registry, admin (folder ``router/``);
* ``kvroute.policies`` — pure decisions: (request facts, index view, load) -> RoutePlan (``policies/``);
* ``kvroute.indexer`` — KV events, block keys, the prefix index and its backends (``indexer/``);
* ``kvroute.config``, ``kvroute.vocabulary``, ``kvroute.tasks`` — config, shared words (Role, KVProtocol,
  Tier) and asyncio helpers, importable by every layer.

``kvroute.sim`` (``sim/``) is a separate program (simulated vLLM workers) sharing only the wire formats
and the bottom layer. ``kvroute.experiment`` / ``kvroute.report`` are the demo's and benchmarks' harness.
"""

__version__ = "0.1.0"
