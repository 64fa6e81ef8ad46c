"""API-key auth (a Bearer token, or Anthropic's `x-api-key` header), and the rule that only
loopback may go without it.

The key is compared in constant time (`hmac.compare_digest`) so response timing says nothing
about how much of a guess was right. `/health` stays open: it tells a load balancer or a
script whether the server is up, and nothing about the model or the conversations.
"""

from __future__ import annotations

import hmac
import ipaddress

from npuchat.engine.errors import NpuchatError

from ..api_keys import ENV_VAR
from .schema import ApiError

OPEN_PATHS = frozenset({"/health"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


def check_bind(host: str, api_keys: tuple[str, ...]) -> None:
    """Refuse to serve beyond this machine without a key."""
    if not is_loopback(host) and not api_keys:
        raise NpuchatError(
            f"--host {host} is reachable from other machines; give --api-key-file FILE (or "
            f"{ENV_VAR}; clients send the key as a Bearer token), or serve on 127.0.0.1"
        )


def given_key(authorization: str | None, x_api_key: str | None) -> bytes:
    """The key a request carries: `Authorization: Bearer <key>` (OpenAI's clients) or
    `x-api-key: <key>` (Anthropic's)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip().encode()
    return (x_api_key or "").strip().encode()


def check_request(path: str, given: bytes, api_keys: tuple[str, ...]) -> None:
    """Raise a 401 ApiError unless `given` (`given_key`) is one of `api_keys` (each compared,
    so the time says nothing of which one matched)."""
    if not api_keys or path in OPEN_PATHS:
        return
    matched = [hmac.compare_digest(given, key.encode()) for key in api_keys]
    if not any(matched):
        raise ApiError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')",
            type="authentication_error",
            code="invalid_api_key",
        )
