"""The redis-py asyncio client for a configured Redis: one server, or a Redis Cluster.

With ``cluster`` the URL names one seed node (``redis://host:port`` or ``rediss://``; database 0 only, as
Cluster has no other): the client reads the slot map from it, learns every node, sends each command to
the master of its key's slot, follows MOVED/ASK redirections and re-reads the map after a failover.
Single-node high availability (Sentinel) is not built in: use Cluster, or a proxy in front of a pair.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

#: Either client: both speak the commands kvroute uses.
AnyRedis = aioredis.Redis | RedisCluster


def redis_client(url: str, *, cluster: bool = False, timeout_s: float | None = None) -> AnyRedis:
    """A client whose every wait (connect, send, read) is bounded by ``timeout_s`` (None: redis-py's own),
    with no retries of its own: callers decide what a failure means."""
    if timeout_s is None:
        return RedisCluster.from_url(url) if cluster else aioredis.Redis.from_url(url)
    if cluster:
        return RedisCluster.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
