"""Who may use the dashboard, and how a browser is kept from being used against it.

The dashboard can pause queues and move messages, so it is treated like any admin page:

- It binds to a loopback address unless told otherwise, and any other address needs a token:
  a queue's payloads are often personal data, and a dashboard left open on a LAN address is
  a well-known way to leak them.
- The token is checked on every request, static files included, with
  :func:`hmac.compare_digest` (a plain ``==`` stops at the first differing byte, which lets a
  patient client guess it byte by byte from response times). A browser presents it once as
  ``?token=``; the answer sets an ``HttpOnly``, ``SameSite=Strict`` cookie and redirects to
  the same page without the query, so the token leaves the address bar and the history.
- Without a token (loopback only), the ``Host`` header must be a loopback name too: a page on
  another site can make its own host name resolve to 127.0.0.1 ("DNS rebinding") and would
  otherwise read the dashboard as same-origin.
- A state-changing request is a POST with a JSON body, from the same origin (``Origin`` and
  ``Sec-Fetch-Site`` when the browser sends them, which every current one does for a POST),
  carrying the per-process CSRF token in a header. A cross-site form cannot set that header
  nor send JSON, and a cross-site script cannot read the token (OWASP's "Cross-Site Request
  Forgery Prevention Cheat Sheet": custom request header, Fetch Metadata and origin checks).
- Every answer forbids framing and MIME sniffing, and the page's Content-Security-Policy
  allows scripts and styles from the dashboard itself only: even if some text ended up in the
  page as markup, no inline script would run. The page inserts every message field with
  ``textContent`` in the first place.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from urllib.parse import urlsplit

from ..errors import ConfigError

TOKEN_ENV = "AIO_KEUSS_DASHBOARD_TOKEN"
"""The environment variable a token can come from (safer than a flag, which ``ps`` shows)."""
COOKIE = "aio_keuss_dashboard"
CSRF_HEADER = "X-CSRF-Token"
MIN_TOKEN_LENGTH = 16

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` keeps the dashboard on this machine. ``0.0.0.0``, ``::``
    and an empty host listen on every interface, so they are not."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token, or with a guessable one."""
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"the dashboard token must be at least {MIN_TOKEN_LENGTH} characters "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe())')"
        )
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"the dashboard binds to {host!r}, which is not a loopback address: give a token "
            f"with --token or {TOKEN_ENV}"
        )


def new_csrf_token() -> str:
    return secrets.token_urlsafe(32)


def same_secret(expected: str, given: str | None) -> bool:
    """Constant-time comparison; a missing value never matches."""
    if given is None:
        return False
    # surrogateescape: a header byte that is not UTF-8 (aiohttp decodes them as such) is
    # a wrong secret, not an encoding error
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogateescape"))


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def loopback_host_header(host: str | None) -> bool:
    """Whether a ``Host`` header names this machine (``localhost``, ``127.x``, ``::1``), with
    or without a port."""
    if not host:
        return False
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return False
    return name is not None and is_loopback(name)


def same_origin(origin: str | None, fetch_site: str | None, host: str | None) -> bool:
    """Whether a POST comes from the dashboard's own page. Each header is checked when the
    browser sends it; a client that sends neither (curl, a script) is not a browser being
    abused, and still needs the CSRF token. ``Origin`` is compared with ``Host`` by host and
    port only: behind a reverse proxy that terminates HTTPS the page's origin is ``https``
    while the dashboard itself is spoken to in plain HTTP."""
    if fetch_site is not None and fetch_site != "same-origin":
        return False
    if origin is not None:
        if host is None:
            return False
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()
    return True
