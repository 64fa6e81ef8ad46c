"""Requests from web pages: a page the user opens must not use a server it was not given.

A server on loopback without a key trusts whatever reaches it, and a browser reaches it for
any page: a page may POST to `http://127.0.0.1:8080` (a "simple" request runs even where its
answer cannot be read), and a page whose name the attacker points at 127.0.0.1 (DNS
rebinding) reads the answers too, its `Host` header still the attacker's name. So:

* a request with an `Origin` header (only browsers send one) is refused unless the origin is
  this machine's (a web UI served from localhost) or one given with `--allow-origin`, the
  policy Ollama applies; CORS headers let those origins' pages read the answers;
* on loopback, a request whose `Host` names anything but this machine is refused (Jupyter's
  rule against rebinding); beyond loopback the API key is what guards the server.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .auth import is_loopback
from .schema import ApiError

# desktop apps' own pages (editors' webviews, Tauri and Electron shells), as Ollama lets them:
# no web page can claim these origins
APP_SCHEMES = ("app", "tauri", "vscode-webview", "vscode-file")
LOOPBACK_ORIGINS = (
    r"https?://(localhost|127\.\d{1,3}\.\d{1,3}\.\d{1,3}|\[::1\])(:\d{1,5})?"
    r"|(app|tauri|vscode-webview|vscode-file)://[^\s]*"
)


def _host_name(host: str) -> str:
    """The name in a `Host` header or an origin's authority, without the port."""
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def allowed_origin(origin: str, allowed: tuple[str, ...]) -> bool:
    """Whether a page from `origin` may use the server: this machine's pages and apps, and
    those given (`--allow-origin`, `*` for any)."""
    if origin in allowed or "*" in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme in APP_SCHEMES:
        return True
    return parts.scheme in ("http", "https") and is_loopback(_host_name(parts.netloc))


def check_browser(
    origin: str | None, host: str | None, allowed: tuple[str, ...], loopback: bool
) -> None:
    """Raise a 403 ApiError for a page's request the server was not given (module doc);
    `loopback`: the server listens on loopback only."""
    if origin is not None and not allowed_origin(origin, allowed):
        raise ApiError(
            403,
            f"requests from pages at {origin[:200]} are refused: a web page could use this "
            f"server without you knowing; start it with --allow-origin {origin[:200]} to let "
            "it",
            type="permission_error",
            code="origin_not_allowed",
        )
    if loopback and host and not is_loopback(_host_name(host)):
        raise ApiError(
            403,
            f"the request names the host {host[:200]!r}, not this machine (a web page may be "
            "reaching the server by rebinding its name); use http://127.0.0.1, or --host to "
            "listen beyond loopback",
            type="permission_error",
            code="host_not_allowed",
        )
