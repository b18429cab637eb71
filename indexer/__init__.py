"""KV events, block keys and the prefix index (memory and Redis backends).

Nothing here knows about HTTP: the router and the standalone indexer process drive it. One job a module:

- ``events``: vLLM's KV-event wire format (decode, and encode for the simulated workers); ``fastdecode``
  the same decoding through typed msgspec schemas, falling back to ``events`` for anything unusual.
- ``keys``: our own block-key chain over token ids, for events and requests alike.
- ``bitsets``: tier bits per block and their counting.
- ``ingest``: one decoded batch -> an entity's local view updated and the index ops that mirror it (pure).
- ``backend``: the index backend contract; ``memory`` and ``redis_index`` (+ ``redis_lua``) implement it.
- ``metrics``: ``IndexerMetrics``, the metric families on a registry handed in, and per-entity children.
- ``sequencing``: per-entity sequence numbers -> apply, duplicate, gap to replay, or purge first.
- ``entities``: the registry of models, workers and their data-parallel ranks (entities).
- ``mirror``: writes to the backend (batched per burst), backend failure, recovery, TTL refresh.
- ``handler``: one worker message in (decode, sequence verdict, translate, mirror, count) and purges.
- ``lookup``: a request's tokens -> keys -> per-entity matches (doubtful entities left out); ``hybrid`` a
  hybrid model's hit, the primary KV-cache group's run cut down by the other groups' rules.
- ``stats``: what the admin API shows.
- ``maintenance``: the indexer-owned periodic upkeep (gone workers, backend recovery, TTL refresh).
- ``subscriber``: the ZMQ event consumer per worker or on one bound socket; ``replays`` its per-worker
  replay jobs (gap fill, restart check against the replay buffer, resync); ``sockets`` socket set-up,
  reconnects and ZAP/CURVE admission; ``reconciliation`` the periodic check against the engines' counts.
- ``service``: ``KVIndexer``, the facade composing the above (what callers hold).
- ``subscriber``: ZMQ sockets feeding a ``KVIndexer`` (it only consumes events).

Imports point one way, down this list roughly: ``subscriber -> service -> handler/lookup/stats/maintenance
-> mirror -> entities -> sequencing/metrics/ingest -> keys/events/backend/bitsets``. Outside the package
only ``kvroute.vocabulary`` (tiers) and ``kvroute.tasks`` (stopping tasks) are used; nothing of
``kvroute.router`` or ``kvroute.policies`` is ever imported here (they import this package).
"""
