"""The processes' tests reuse the HTTP tier's fixtures (fake workers, a client) and the indexer tier's."""

from tests.http.conftest import client, two_workers
from tests.indexer.conftest import zctx

__all__ = ["client", "two_workers", "zctx"]
