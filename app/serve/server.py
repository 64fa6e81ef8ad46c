"""The ASGI app and the uvicorn server that runs it.

`create_app` wires the routes over any `ChatEngine`; `Server` runs uvicorn in a background
thread (tests, the load benchmark) or in the foreground (`npuchat serve`). Errors anywhere in
the app become OpenAI error objects (Anthropic's on its API's paths): a traceback goes to the
log, never to a client.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npuchat.engine.events import ChatEngine

from . import auth, messages_route, responses_route, routes, tokens
from .args import DEFAULT_MAX_QUEUE
from .browsers import LOOPBACK_ORIGINS, check_browser
from .metrics import ServerMetrics
from .routes import ServedModel, Service, error_response
from .runner import Admission
from .schema import ApiError

log = logging.getLogger(__name__)


class _Guard:
    """Pure ASGI middleware (streaming-safe): the API key check and per-endpoint counts."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            service = self.service
            check_browser(headers.get("origin"), headers.get("host"), *service.browsers)
            given = auth.given_key(headers.get("authorization"), headers.get("x-api-key"))
            auth.check_request(path, given, service.api_keys)
        except ApiError as exc:
            await _answer(exc, path)(scope, receive, counting_send)
        else:
            await self.app(scope, receive, counting_send)
        finally:
            endpoint = path if path in _KNOWN_PATHS else "other"
            self.service.metrics.record_request(endpoint, status)


def _answer(exc: ApiError, path: str) -> Response:
    return error_response(exc, anthropic=path in messages_route.PATHS)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _answer(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = (
        f"no such endpoint: {request.method} {request.url.path}"
        if exc.status_code in (404, 405)
        else str(exc.detail)
    )
    return _answer(ApiError(exc.status_code, message, type=kind), request.url.path)


async def _bug(request: Request, exc: Exception) -> Response:
    log.error("request failed", exc_info=exc)
    error = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return _answer(error, request.url.path)


_API = [
    ("/chat/completions", routes.chat_completions, "POST"),
    ("/completions", routes.completions, "POST"),
    ("/responses", responses_route.create, "POST"),
    ("/messages", messages_route.create, "POST"),
    ("/messages/count_tokens", messages_route.count_tokens, "POST"),
    ("/models", routes.models, "GET"),
    ("/models/{name:path}", routes.model, "GET"),
    ("/responses/{response_id}", responses_route.kept, "GET"),
    ("/responses/{response_id}", responses_route.kept, "DELETE"),
]
# llama-server's and vLLM's token endpoints, which neither puts under /v1
_TOKENS = [("/tokenize", tokens.tokenize), ("/detokenize", tokens.detokenize)]
# the API under /v1 and, as llama-server serves it, at the root too: a client given the
# server's address without /v1 as its base URL works
_ROUTES = [
    *(
        Route(root + path, call, methods=[verb])
        for root in ("/v1", "")
        for path, call, verb in _API
    ),
    *(Route(path, call, methods=["POST"]) for path, call in _TOKENS),
    Route("/health", routes.health, methods=["GET"]),
    Route("/metrics", routes.prometheus, methods=["GET"]),
]
_KNOWN_PATHS = frozenset(r.path for r in _ROUTES if "{" not in r.path)


def create_app(
    engine: ChatEngine,
    model: ServedModel,
    *,
    api_keys: tuple[str, ...] = (),
    max_queue: int = DEFAULT_MAX_QUEUE,
    slots: int | None = 1,
    max_body_bytes: int = routes.MAX_BODY_BYTES,
    allowed_origins: tuple[str, ...] = (),
    loopback: bool = True,
) -> Starlette:
    """The service over `engine`. `slots`: replies the engine runs at once (None: the engine
    schedules and queues them itself); `allowed_origins`: web pages beyond this machine's
    that may use it (`browsers`); `loopback`: it listens on loopback only."""
    admission = Admission(slots, max_queue)
    metrics = ServerMetrics(model.id, model.draft, model.device, admission.load)
    service = Service(
        engine,
        model,
        admission,
        metrics,
        api_keys,
        max_body_bytes,
        started=time.time(),
        browsers=(allowed_origins, loopback),
    )
    app = Starlette(
        routes=_ROUTES,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _bug,
        },
    )
    app.state.service = service
    app.add_middleware(_Guard, service=service)
    # the pages `_Guard` lets in may read the answers (and ask first: preflight requests)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(allowed_origins),
        allow_origin_regex=LOOPBACK_ORIGINS,
        allow_methods=["GET", "POST", "DELETE"],
        allow_headers=["*"],
        expose_headers=["Retry-After"],
    )
    return app


class Server:
    """uvicorn serving `app` on host:port (port 0: an ephemeral one, see `port` once started)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, **kw: Any) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=kw.pop("log_level", "warning"),
            timeout_graceful_shutdown=kw.pop("timeout_graceful_shutdown", 5),
            **kw,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            sockets = [s for server in self._server.servers for s in server.sockets]
            self._port = int(sockets[0].getsockname()[1])
        return self._port

    @property
    def url(self) -> str:
        """The base URL clients use (once started)."""
        return self.url_for(self.port)

    def url_for(self, port: int) -> str:
        host = self._server.config.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def run(self) -> None:
        """Serve in this thread until interrupted."""
        self._server.run()

    def start(self, timeout_s: float = 10.0) -> Server:
        """Serve from a background thread; returns once the socket listens."""
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="uvicorn")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        _ = self.port  # read while the socket is open
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def stopped(self) -> bool:
        """Whether the background thread has ended (a response that never ends keeps it, and
        its CPU, past `stop`)."""
        return self._thread is None or not self._thread.is_alive()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["DEFAULT_MAX_QUEUE", "ServedModel", "Server", "create_app"]
