"""A `ChatEngine` that is a client of any OpenAI-compatible server (`npuchat --server URL`).

npuchat serve, llama-server, vLLM and ollama all stream `/v1/chat/completions` as server-sent
events; this engine turns those chunks into the port's events, so the app chats with a served
model exactly as with a local one. What the client can measure it measures itself (TTFT from
sending the request, the decode rate from the chunks' arrival); when the server is npuchat, the
figures only the server knows (prefill rate, reused tokens, draft acceptance, KV fill) come from
the `npuchat` field of its last chunk. Cancel closes the connection at once, which an npuchat
server (and llama-server) takes as a cancel.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from npuchat.app.engine_port import EngineLoader, EngineSpec, ProgressCallback
from npuchat.engine.chat_template import template_messages, template_tools
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatRequest,
    Event,
    Failed,
    FailureKind,
    Metrics,
)
from npuchat.engine.grammar import ANY_OBJECT

from .openai_reply import StreamedReply
from .remote_context import context_counts, dropped_notice, is_context_error, shortened

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a long prefill on a slow server sends nothing for a while
MAX_ERROR_BYTES = 64 << 10  # of a refusal's body: its message is a line or two


@dataclass(frozen=True)
class ServerModel:
    id: str
    context_length: int = 0
    draft: str = ""
    device: str = ""
    npuchat: bool = False


def base_url(url: str) -> str:
    """`http://host:8080`, `…/v1` or `…/v1/` → the `/v1` base every endpoint hangs off."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise NpuchatError(f"--server {url}: give an http:// or https:// URL")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def _error(response: httpx.Response) -> dict[str, Any]:
    """The response's error object (OpenAI's `{"error": {...}}`), its message always set. At
    most `MAX_ERROR_BYTES` of the body are read: a server's endless refusal fills no memory."""
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > MAX_ERROR_BYTES:
            break
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        error = None
    fields = error if isinstance(error, dict) else {"message": error}
    text = bytes(body[:200]).decode("utf-8", "replace")
    message = fields.get("message") or text or response.reason_phrase
    return fields | {"message": str(message)}


def _error_message(response: httpx.Response) -> str:
    return str(_error(response)["message"])


def _kind(status: int) -> FailureKind:
    return "busy" if status in (429, 503) else "invalid" if 400 <= status < 500 else "error"


def remote_loader(url: str, api_key: str | None, model: str | None) -> EngineLoader:
    """An EngineLoader for the app: every spec is served by the server (its `model`, or the
    first it lists); nothing is pulled or loaded here."""

    def load(spec: EngineSpec, progress: ProgressCallback) -> OpenAIEngine:
        progress(f"connecting to {url}", 0.0)
        return OpenAIEngine(url, api_key=api_key, model=model)

    return load


def _models(client: httpx.Client, url: str) -> list[ServerModel]:
    try:
        response = client.get("/models")
    except httpx.HTTPError as exc:
        raise NpuchatError(f"cannot reach {url}: {exc}; is the server running?") from None
    if response.status_code == 401:
        raise NpuchatError(f"{url} wants an API key: give --api-key-file FILE or NPUCHAT_API_KEY")
    if response.status_code != 200:
        raise NpuchatError(
            f"{url}/models answered {response.status_code}: {_error_message(response)}"
        )
    out = []
    try:
        for item in response.json().get("data", []):
            ext = item.get("npuchat") or {}
            meta = item.get("meta") or {}
            out.append(
                ServerModel(
                    id=str(item["id"]),
                    context_length=int(item.get("context_length") or meta.get("n_ctx") or 0),
                    draft=str(ext.get("draft") or ""),
                    device=str(ext.get("device") or ""),
                    npuchat="npuchat" in item,
                )
            )
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
        raise NpuchatError(
            f"{url}/models did not answer as an OpenAI-compatible server does; is the URL right?"
        ) from None
    return out


class OpenAIEngine:
    """The port over HTTP. Several threads may call `generate` at once: each reply is its own
    request, and the server decides whether to run them together or answer 429 (→ busy)."""

    def __init__(self, url: str, *, api_key: str | None = None, model: str | None = None) -> None:
        self.url = base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        try:
            models = _models(self._client, self.url)
            if not models:
                raise NpuchatError(f"{self.url} serves no models")
            chosen = next((m for m in models if m.id == model), None) if model else models[0]
            if chosen is None:
                names = ", ".join(m.id for m in models)
                raise NpuchatError(f"{self.url} does not serve {model}; it serves {names}")
        except BaseException:
            self._client.close()
            raise
        self.served = chosen
        self._host = urlsplit(self.url).netloc

    @property
    def model_name(self) -> str:
        return self.served.id

    @property
    def draft_name(self) -> str:
        return self.served.draft

    @property
    def device(self) -> str:
        where = f"{self.served.device} at " if self.served.device else ""
        return f"{where}{self._host}"

    def close(self) -> None:
        self._client.close()

    def _base_metrics(self) -> Metrics:
        """What a reply's figures start from: the served model as its list described it."""
        return Metrics(
            model=self.served.id,
            draft=self.served.draft,
            device=self.device,
            kv_max_capacity=self.served.context_length,
        )

    def _body(self, request: ChatRequest) -> tuple[str, dict[str, Any]]:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.served.id,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.stop:
            body["stop"] = list(s.stop)
        if s.seed is not None:
            body["seed"] = s.seed
        if s.json_schema == ANY_OBJECT:  # JSON mode, which every OpenAI-style server takes
            body["response_format"] = {"type": "json_object"}
        elif s.json_schema is not None:
            schema = {"name": "reply", "schema": json.loads(s.json_schema)}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.served.npuchat:  # extensions only where the server is known to take them
            body |= {"top_k": s.top_k, "min_p": s.min_p, "repeat_penalty": s.repeat_penalty}
            body["priority"] = request.priority
        if request.raw_prompt is not None:
            return "/completions", body | {"prompt": request.raw_prompt}
        body["messages"] = template_messages(request.system_prompt, request.messages)
        for m in body["messages"]:
            for call in m.get("tool_calls", ()):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        if tools := template_tools(request.tools):
            body["tools"] = tools
        if (
            request.continue_reply
            and request.messages[-1:]
            and request.messages[-1].role == "assistant"
        ):
            # vLLM's spelling, which npuchat serve takes; llama-server continues a final
            # assistant message by itself and ignores the two fields
            body |= {"continue_final_message": True, "add_generation_prompt": False}
        return "/chat/completions", body

    def generate(self, request: ChatRequest, cancel: threading.Event) -> Iterator[Event]:
        t_request = time.perf_counter()
        asked = request
        try:
            while not cancel.is_set():
                path, body = self._body(asked)
                with self._client.stream("POST", path, json=body) as response:
                    if response.status_code == 200:
                        if asked is not request:
                            yield dropped_notice(request, asked)
                        reply = StreamedReply(self._base_metrics(), response, cancel, t_request)
                        yield from reply.events()
                        return
                    error = _error(response)
                    fitted = None
                    if response.status_code == 400 and is_context_error(error):
                        fitted = shortened(asked, context_counts(error))
                    if fitted is None:  # some other error, or no turn left to drop
                        yield Failed(str(error["message"]), _kind(response.status_code))
                        return
                    asked = fitted  # the oldest turns dropped (remote_context): ask again
            yield Cancelled(Metrics(model=self.served.id, device=self.device))
        except (httpx.HTTPError, httpx.StreamError) as exc:
            if cancel.is_set():
                yield Cancelled(Metrics(model=self.served.id, device=self.device))
            else:
                yield Failed(f"the server at {self._host} failed: {exc}")
