"""The origin (scheme and host) a request was sent to, as its client saw it, and whether a form post came from it.

Behind a TLS-terminating reverse proxy the proxy's own request is plain HTTP to another
host; the reverse proxy says what the client used in `X-Forwarded-Proto` and
`X-Forwarded-Host`. Anyone can send those headers, so they are believed only from a direct
peer listed in `proxy.trusted_proxies`. Used by the dashboard's sign-in (its cookie's
`Secure` flag, its cross-site check); the relay never reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from urllib.parse import urlsplit

from starlette.requests import Request

__all__ = ["Origin", "is_https", "is_same_origin_post", "request_origin"]

Origin = tuple[str, str, int]  # (scheme, host in lower case, port)

_DEFAULT_PORTS = {"http": 80, "https": 443}
# Sec-Fetch-Site values a browser sends for a form the dashboard itself served ("none": typed or
# bookmarked). "same-site" (a sibling subdomain) and "cross-site" are refused.
_SAME_SITE_FETCHES = {"same-origin", "none"}


def _peer_is_trusted(request: Request, trusted: Sequence[str]) -> bool:
    if not trusted or request.client is None:
        return False
    try:
        peer: IPv4Address | IPv6Address = ip_address(request.client.host)
    except ValueError:  # a Unix socket's path, or no address at all
        return False
    if isinstance(peer, IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return any(peer in ip_network(entry) for entry in trusted)


def _last(value: str | None) -> str:
    # Each proxy in a chain appends its own value: the last is the one our direct peer added.
    return (value or "").rpartition(",")[2].strip()


def _parse(scheme: str, host: str) -> Origin | None:
    """(scheme, host, port) of `scheme://host`; None when it is no origin (no host, a port past 65535)."""
    try:
        parts = urlsplit(f"{scheme}://{host}")
        port = parts.port
    except ValueError:
        return None
    if (scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None or parts.path
            or parts.query or parts.fragment):
        return None
    return scheme, parts.hostname.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


def request_origin(request: Request, trusted: Sequence[str]) -> Origin | None:
    """The origin the client sent this request to; None when its Host header names none."""
    scheme, host = request.url.scheme, request.headers.get("host", "")
    if _peer_is_trusted(request, trusted):
        forwarded_scheme = _last(request.headers.get("x-forwarded-proto")).lower()
        if forwarded_scheme in _DEFAULT_PORTS:
            scheme = forwarded_scheme
        host = _last(request.headers.get("x-forwarded-host")) or host
    return _parse(scheme, host)


def is_https(request: Request, trusted: Sequence[str]) -> bool:
    """Whether the client sent this request over HTTPS: to us directly, or to a trusted reverse proxy."""
    if request.url.scheme == "https":
        return True
    return _peer_is_trusted(request, trusted) and _last(request.headers.get("x-forwarded-proto")).lower() == "https"


def is_same_origin_post(request: Request, trusted: Sequence[str]) -> bool:
    """Whether a state-changing request came from a page of this origin (not a cross-site form).

    Browsers send `Sec-Fetch-Site` and, on a POST, `Origin`; a script (curl) sends neither and
    is let through, as it holds the token it posts anyway.
    """
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() not in _SAME_SITE_FETCHES:
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True
    scheme, _, host = origin.strip().partition("://")
    sent = _parse(scheme.lower(), host)  # "null" (a sandboxed or file: page) parses as no origin
    return sent is not None and sent == request_origin(request, trusted)
