"""kvroute: a KV-cache-aware router for vLLM worker pools.

The distribution installs four subpackages under this namespace: ``kvroute.indexer`` (KV events and
the prefix index), ``kvroute.policies`` (routing decisions), ``kvroute.router`` (HTTP, forwarding,
admin, CLI) and ``kvroute.sim`` (simulated vLLM workers).
"""

__version__ = "0.1.0"
