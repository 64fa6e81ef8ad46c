"""Web pages and the server: a page from elsewhere cannot use it (a request carrying its
`Origin`, or a rebound name in `Host`), pages from this machine and those allowed can, and
read the answers (CORS); clients that are not browsers are unaffected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, ScriptedReply
from serve_helpers import serving

from npuchat.app.cli import main
from npuchat.app.serve.server import Server

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGE = {"max_tokens": 8, **CHAT}


def _post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def test_a_page_from_elsewhere_is_refused_and_this_machine_s_pages_are_served() -> None:
    engine = ScriptedEngine([ScriptedReply(["ok"]) for _ in range(3)])
    with serving(engine) as (server, _):
        url = server.url
        evil = _post(url, "/v1/chat/completions", CHAT, Origin="https://evil.example")
        evil_messages = _post(url, "/v1/messages", MESSAGE, Origin="https://evil.example")
        local = _post(url, "/v1/chat/completions", CHAT, Origin="http://localhost:3000")
        plain = _post(url, "/v1/chat/completions", CHAT)  # no Origin: not a browser
        webview = _post(url, "/v1/chat/completions", CHAT, Origin="vscode-webview://abc123")
        null = _post(url, "/v1/chat/completions", CHAT, Origin="null")  # a file or sandbox
        asked = httpx.options(
            url + "/v1/chat/completions",
            headers={
                "Origin": "http://127.0.0.1:5173",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, authorization",
            },
        )
        asked_evil = httpx.options(
            url + "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    assert "--allow-origin https://evil.example" in evil.json()["error"]["message"]
    assert "access-control-allow-origin" not in evil.headers
    assert evil_messages.status_code == 403  # Anthropic's error shape there
    assert evil_messages.json()["error"]["type"] == "permission_error"
    assert local.status_code == 200 and local.json()["choices"][0]["message"]["content"] == "ok"
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert plain.status_code == 200
    assert webview.status_code == 200  # an editor's own page
    assert webview.headers["access-control-allow-origin"] == "vscode-webview://abc123"
    assert null.status_code == 403
    assert asked.status_code == 200
    assert asked.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"
    assert "access-control-allow-origin" not in asked_evil.headers
    assert len(engine.requests) == 3  # the refused pages ran nothing


def test_an_allowed_origin_is_served() -> None:
    engine = ScriptedEngine([ScriptedReply(["ok"])])
    with serving(engine, allowed_origins=("https://ui.example",)) as (server, _):
        r = _post(server.url, "/v1/chat/completions", CHAT, Origin="https://ui.example")
        other = _post(server.url, "/v1/chat/completions", CHAT, Origin="https://ui.example:8443")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    assert other.status_code == 403


@pytest.mark.parametrize("loopback", [True, False])
def test_a_rebound_host_name_is_refused_on_loopback(loopback: bool) -> None:
    """On loopback a request must name this machine; beyond it the API key guards."""
    engine = ScriptedEngine([ScriptedReply(["ok"]) for _ in range(3)])
    with serving(engine, loopback=loopback) as (server, _):
        rebound = _post(server.url, "/v1/chat/completions", CHAT, Host="evil.example:8080")
        named = [
            _post(server.url, "/v1/chat/completions", CHAT, Host=host).status_code
            for host in ("localhost:8080", "[::1]:8080")
        ]
    if loopback:
        assert rebound.status_code == 403
        assert rebound.json()["error"]["code"] == "host_not_allowed"
        assert "\n" not in rebound.json()["error"]["message"]
    else:
        assert rebound.status_code == 200
    assert named == [200, 200]


def test_serve_takes_allowed_origins(
    syn: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    apps: list[Any] = []
    monkeypatch.setattr(Server, "run", lambda self: apps.append(self._server.config.app))
    origins = ["--allow-origin", "https://a.example", "--allow-origin", "https://b.example"]
    assert main(["serve", "--model", "syn", "--port", "0", *origins]) == 0
    assert main(["serve", "--model", "syn", "--port", "0", "--host", "0.0.0.0"]) == 2  # no key
    (app,) = apps
    assert app.state.service.browsers == (("https://a.example", "https://b.example"), True)
