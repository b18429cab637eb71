"""Who may use the admin API: secure by default.

* With an ``admin_token``: every admin route needs ``Authorization: Bearer <token>``.
* Without one: read-only admin routes answer only clients on the loopback interface, and routes that change
  anything (adding or removing workers, purging the index) are disabled — they can move traffic and read
  internal hosts through the proxy, so they never run unauthenticated.

Shared by the router's admin app and the stand-alone indexer's index admin API.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from kvroute.router.errors import ApiError
from starlette.requests import Request

Token = str | None | Callable[[], str | None]

_READ_ONLY = frozenset({"GET", "HEAD", "OPTIONS"})


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bearer_matches(request: Request, token: str) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


def check_admin(request: Request, token: Token, *, read_only: bool | None = None) -> None:
    """Raise 401/403 unless ``request`` may use this admin route (``token`` may be read per request).
    ``read_only`` overrides what the method says (a POST that only computes, like explain or a lookup)."""
    configured = token() if callable(token) else token
    if configured:
        if not bearer_matches(request, configured):
            raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin token>'", "unauthorized")
        return
    if not (request.method in _READ_ONLY if read_only is None else read_only):
        raise ApiError(
            403,
            "admin routes that change the pool or the index are disabled until an admin_token is configured",
            "admin_token_required",
            "permission_error",
        )
    if not _is_loopback(request.client.host if request.client else None):
        raise ApiError(
            403,
            "without an admin_token the admin API answers loopback clients only",
            "admin_loopback_only",
            "permission_error",
        )


#: Cloud metadata services reachable by name; refused like link-local addresses unless allowlisted.
_METADATA_NAMES = frozenset({"metadata.google.internal", "metadata", "instance-data"})


def worker_refusal(url: str, allowlist: Sequence[str]) -> str | None:
    """Why a worker URL may not be added at run time (None: it may). ``allowlist`` entries are CIDRs, host
    names or ``.domain`` suffixes; without entries any host is allowed except link-local / metadata ones."""
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    networks = []
    names = []
    for entry in allowlist:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.append(entry.lower().rstrip("."))
    covered = (
        any(address in net for net in networks)
        if address is not None
        else any(host == n or (n.startswith(".") and host.endswith(n)) for n in names)
    )
    if address is not None and (address.is_link_local or address.is_unspecified or address.is_multicast):
        return None if covered else f"{host} is a link-local/metadata or non-unicast address"
    if address is None and host in _METADATA_NAMES and not covered:
        return f"{host} is a cloud metadata service"
    if allowlist and not covered:
        return f"{host} is not in admin_worker_allowlist"
    return None
