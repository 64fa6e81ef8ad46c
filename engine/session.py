"""Conversation sessions: the `ChatEngine` the UI and `npuchat run` talk to.

A `ChatSession` owns one loaded model and remembers which tokens' K/V are in its cache. Each
request is rendered with the model's chat template and tokenized in full; the longest common
prefix with the cache (or with a stored prefix: see `prefix_store`) is reused and only the rest
is prefilled. Multi-turn chats therefore prefill just the new message, and edits or regenerations
roll back to the point where the token sequences diverge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from .chat_template import ChatTemplate, template_messages, template_tools
from .drafters import Drafter
from .errors import InvalidRequestError, NpuchatError
from .events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Finished,
    Metrics,
    MetricsUpdate,
    Notice,
    SamplingParams,
    StopReason,
    TokenDelta,
    ToolSpec,
)
from .model import Model
from .prefix_store import PrefixStore, common_prefix_len
from .sampler import Sampler
from .sampling_domain import sampling_problems
from .speculative import SpeculativeDecoder
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 0.1  # live metrics at most ~10 Hz
_PROBE_A, _PROBE_B = "\x01a", "\x02b"  # two user messages that share no token


MIN_PREFIX_BUDGET = 32 << 20
SYSTEM_CACHE_SIZE = 32
"""System prompts whose token prefix is remembered (each a short list of ids)."""


@dataclass(frozen=True)
class SessionOptions:
    # RAM for kept prefixes (other conversations, system prompts); None: a quarter of the model
    # file, at least MIN_PREFIX_BUDGET. A fixed 512 MiB let a long session of new conversations
    # grow a 98 MB model's process by hundreds of MB; tied to the model, it stays in the RSS
    # budget (1.3x the GGUF plus the KV cache). Evicted prefixes of system prompts stay on disk.
    prefix_budget_bytes: int | None = None
    persist_prefixes: bool = True
    # A chat app idles between turns, and this kind of machine reclaims pages left untouched for
    # ~60 s (the mapped weights, ORT's code); the next turn then faults them back in slowly. A
    # one-token decode (rolled back) every `keep_warm_s` of idleness keeps them resident for a
    # few ms of CPU. 0 (the default, for library use and tests) turns it off; the app sets it.
    # It only runs on the CPU (a simulated NPU step costs seconds).
    keep_warm_s: float = 0.0


class _StopMatcher:
    """Holds back text that might be the start of a stop string, so none is ever shown."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.buffer += text
        for stop in self.stops:
            at = self.buffer.find(stop)
            if at >= 0:
                out, self.buffer = self.buffer[:at], ""
                return out, True
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class ChatSession:
    """One model (plus its cache and stored prefixes), serving one generation at a time."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        *,
        name: str,
        device: str,
        prefix_dir: Path | None = None,
        options: SessionOptions | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self._name = name
        self._device = device
        self._clock = clock
        opts = options or SessionOptions()
        budget = opts.prefix_budget_bytes
        if budget is None:
            budget = max(MIN_PREFIX_BUDGET, model.path.stat().st_size // 4)
        self.prefixes = PrefixStore(
            model.graph_dir.name,
            budget_bytes=budget,
            disk_dir=prefix_dir if opts.persist_prefixes else None,
        )
        self._tokens: list[int] = []  # tokens whose K/V are in slots [0, n_past)
        self.speculative: SpeculativeDecoder | None = None  # see use_drafters
        self._system_cache: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # held while the model runs (a reply or a warm tick)
        self._state = threading.Lock()  # guards _generating
        self._generating = False
        self._last_used = clock()
        self._closed = threading.Event()
        self.warm_ticks = 0
        if opts.keep_warm_s > 0 and device == "cpu":
            threading.Thread(
                target=self._keep_warm, args=(opts.keep_warm_s,), daemon=True, name="keep-warm"
            ).start()
        self.stop_ids = set(tokenizer.eot_ids)
        marker = template.end_marker
        if marker is not None and (mid := tokenizer.token_to_id(marker)) is not None:
            self.stop_ids.add(mid)

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        name: str,
        cache_dir: Path,
        device: str = "cpu",
        threads: int | None = None,
        progress: Callable[[str, float], None] | None = None,
        options: SessionOptions | None = None,
        **model_kw: object,
    ) -> ChatSession:
        model = Model.load(
            path,
            cache_dir=cache_dir,
            device=device,
            threads=threads,
            progress=progress,
            **model_kw,  # type: ignore[arg-type]
        )
        from .gguf_reader import GGUFFile

        with GGUFFile(path) as g:
            tokenizer = Tokenizer.from_gguf(g)
            template = ChatTemplate.from_gguf(g)
        return cls(
            model,
            tokenizer,
            template,
            name=name,
            device=device,
            prefix_dir=cache_dir / "prefixes",
            options=options,
        )

    # ChatEngine protocol
    @property
    def model_name(self) -> str:
        return self._name

    @property
    def draft_name(self) -> str:
        return self.speculative.name if self.speculative is not None else ""

    def use_drafters(self, drafters: Sequence[Drafter], **kw: object) -> None:
        """Decode speculatively with these drafters (tried in order each round); none: plain.

        The decoder's cost model is calibrated here (a decode and a few verify widths timed),
        so even the first reply chooses k from measured costs.
        """
        if self.speculative is not None:
            self.speculative.close()
        self.speculative = self.make_decoder(drafters, **kw) if drafters else None

    def make_decoder(self, drafters: Sequence[Drafter], **kw: object) -> SpeculativeDecoder:
        """A speculative decoder over this session's model, its cost model calibrated."""
        decoder = SpeculativeDecoder(self.model, drafters, **kw)  # type: ignore[arg-type]
        decoder.calibrate()
        return decoder

    @contextmanager
    def decoding_with(self, decoder: SpeculativeDecoder | None) -> Iterator[None]:
        """Decode with `decoder` (None: plainly) for the requests made inside the block, then
        with the session's own again (benchmarks compare drafter modes on one session). The
        caller keeps `decoder` and closes it."""
        own = self.speculative
        self.speculative = decoder
        try:
            yield
        finally:
            self.speculative = own

    @property
    def device(self) -> str:
        return self._device

    @property
    def cached_tokens(self) -> list[int]:
        return list(self._tokens)

    def _keep_warm(self, interval: float) -> None:
        """Touch every weight once per idle interval (see SessionOptions.keep_warm_s)."""
        while not self._closed.wait(interval / 2):
            if self._clock() - self._last_used < interval or not self._lock.acquire(False):
                continue
            try:
                model = self.model
                n = model.n_past
                if not self._closed.is_set() and 0 < n < model.max_capacity and self._tokens:
                    model.decode(self._tokens[-1])  # writes slot n only; rolled back below
                    model.rollback(n)
                    self.warm_ticks += 1
                    self._last_used = self._clock()
            except Exception:  # a warm tick must never take the app down
                log.exception("keep-warm tick failed")
            finally:
                self._lock.release()

    def close(self) -> None:
        self._closed.set()
        if self._lock.acquire(timeout=5):  # let a warm tick in progress finish first
            self._lock.release()
        if self.speculative is not None:
            self.speculative.close()
        self.model.close()

    # ------------------------------------------------------------------ prompt

    def prompt_ids(
        self,
        system: str,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
        continue_reply: bool = False,
    ) -> list[int]:
        """The request's prompt ids: the template's markup with special tokens parsed, every
        message's text as plain text (so user text cannot forge a turn). `continue_reply`: the
        last (assistant) message is left open, its text after the assistant header."""
        if continue_reply and messages and messages[-1].role == "assistant":
            # the reply's own text after the assistant header: its KV is mostly still cached
            head = self.prompt_ids(system, messages[:-1], tools)
            return head + self.tokenizer.encode(messages[-1].content)
        pieces = self.template.render_pieces(
            template_messages(system, messages), True, template_tools(tools)
        )
        return self.tokenizer.encode_chat(pieces)

    def system_prefix(self, system: str) -> list[int]:
        """Tokens every conversation with this system prompt starts with.

        Rendered twice with two unrelated user messages: whatever the template writes before the
        user's text (BOS, the system block, the user header) is the common token prefix.
        """
        if system in self._system_cache:
            self._system_cache[system] = self._system_cache.pop(system)  # most recent last
        else:
            a = self.prompt_ids(system, [ChatMessage("user", _PROBE_A)])
            b = self.prompt_ids(system, [ChatMessage("user", _PROBE_B)])
            self._system_cache[system] = a[: common_prefix_len(a, b)]
            while len(self._system_cache) > SYSTEM_CACHE_SIZE:
                del self._system_cache[next(iter(self._system_cache))]
        return self._system_cache[system]

    def _fit(self, request: ChatRequest) -> tuple[list[int], int]:
        """Prompt ids that leave room for a reply, dropping the oldest turns if needed.

        Returns (ids, dropped turn count). The reply budget is max_tokens, capped at a quarter
        of the context so that a long conversation still gets a useful reply budget.
        """
        cap = self.model.max_capacity
        reserve = max(1, min(request.sampling.max_tokens, cap // 4))
        messages = list(request.messages)
        dropped = 0
        ids = self.prompt_ids(
            request.system_prompt, messages, request.tools, request.continue_reply
        )
        while len(ids) + reserve > cap:
            # a turn = one user message and the replies after it; the last user message stays
            firsts = [i for i, m in enumerate(messages) if m.role == "user"]
            if len(firsts) < 2:
                break
            messages = messages[firsts[1] :]
            dropped += 1
            ids = self.prompt_ids(
                request.system_prompt, messages, request.tools, request.continue_reply
            )
        if len(ids) >= cap:
            raise InvalidRequestError(
                f"the message is too long: the prompt is {len(ids)} tokens and {self._name} "
                f"holds {cap}; shorten it or start a new conversation"
            )
        return ids, dropped

    # ------------------------------------------------------------------ KV reuse

    def _reuse(self, ids: list[int]) -> tuple[int, str]:
        """Put the longest available prefix of `ids` in the cache; (reused tokens, source)."""
        limit = len(ids) - 1  # the last prompt token is always run: its logits start the reply
        lcp = min(common_prefix_len(self._tokens, ids), limit)
        if lcp < len(self._tokens) and len(self._tokens) > lcp + 16:
            # switching away from a longer state: keep it for when the user comes back
            self.prefixes.put(self._tokens, self.model.kv_export)
        hit = self.prefixes.lookup(ids, limit)
        if hit is not None and hit.length > lcp:
            self.model.rollback(0)
            self.model.kv_import(hit.snapshot, 0)
            self._tokens = ids[: hit.length]
            return hit.length, hit.source
        self.model.rollback(lcp)
        self._tokens = ids[:lcp]
        return lcp, "cache"

    def _remember_system(self, system: str, ids: list[int]) -> None:
        prefix = self.system_prefix(system)
        if prefix and ids[: len(prefix)] == prefix and len(self._tokens) >= len(prefix):
            self.prefixes.put(prefix, self.model.kv_export, pinned=True)
            self.prefixes.persist(prefix, self.model.kv_export)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        request: ChatRequest,
        cancel: threading.Event,
        *,
        sampling: SamplingParams | None = None,
    ) -> Iterator[Event]:
        params = sampling if sampling is not None else getattr(request, "sampling", None)
        problems = sampling_problems(params) if params is not None else []
        if problems:
            yield Failed("; ".join(f"{name} {why}" for name, why in problems), kind="invalid")
            return
        if isinstance(request, ChatRequest) and request.raw_prompt is not None:  # no template
            ids = self.tokenizer.encode_prompt(request.raw_prompt)
            yield from self.complete(ids, request.sampling, cancel)
            return
        with self._state:
            busy, self._generating = self._generating, True
        if busy:
            yield Failed(
                "a reply is already being generated; wait for it or stop it first", kind="busy"
            )
            return
        self._lock.acquire()  # at most one warm tick (one decode step) to wait for
        try:
            yield from self._generate(request, cancel, sampling)
        except NpuchatError as exc:
            yield Failed(str(exc), "invalid" if isinstance(exc, InvalidRequestError) else "error")
        except Exception as exc:  # a bug: keep the traceback in the log, not on screen
            log.exception("generation failed")
            yield Failed(f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self._tokens = self._tokens[: self.model.n_past]
            self._last_used = self._clock()
            self._lock.release()
            with self._state:
                self._generating = False

    def complete(
        self, ids: Sequence[int], sampling: SamplingParams, cancel: threading.Event
    ) -> Iterator[Event]:
        """Continue raw prompt ids (no chat template): `npuchat run --raw`, benchmarks."""
        ids = list(ids)
        if not ids:
            yield Failed("the prompt is empty", "invalid")
            return
        if len(ids) >= self.model.max_capacity:
            yield Failed(
                f"the prompt is {len(ids)} tokens and {self._name} holds "
                f"{self.model.max_capacity}; shorten it",
                "invalid",
            )
            return
        yield from self.generate(ids, cancel, sampling=sampling)  # type: ignore[arg-type]

    def _generate(
        self,
        request: ChatRequest | list[int],
        cancel: threading.Event,
        sampling: SamplingParams | None = None,
    ) -> Iterator[Event]:
        clock = self._clock
        t_request = clock()
        if isinstance(request, ChatRequest):
            params = request.sampling
            system = request.system_prompt
            ids, dropped = self._fit(request)
            if dropped:
                yield Notice(
                    f"dropped {dropped} oldest turn{'s' * (dropped != 1)} to fit "
                    f"{self.model.max_capacity} tokens",
                    "warning",
                )
            if self.template.warning:
                yield Notice(self.template.warning, "warning")
        else:
            assert sampling is not None
            params, system, ids = sampling, None, request
        reused, _source = self._reuse(ids)
        for warning in self.prefixes.warnings:
            yield Notice(warning, "warning")
        self.prefixes.warnings.clear()
        model = self.model
        t_prefill = clock()
        todo = ids[reused:]
        step = model.prefill_chunk
        for start in range(0, len(todo), step):
            logits = model.prefill(todo[start : start + step])
            done = min(len(todo), start + step)
            if done < len(todo):  # a long prompt: say how far its prefill is
                elapsed = clock() - t_prefill
                yield MetricsUpdate(
                    Metrics(
                        prefill_tokens=done,
                        prefill_tps=done / elapsed if elapsed > 0 else 0.0,
                        prefill_total=len(todo),
                        reused_tokens=reused,
                        model=self._name,
                        device=self._device,
                    )
                )
        prefill_s = clock() - t_prefill
        self._tokens = list(ids)
        if system is not None:
            self._remember_system(system, ids)

        base = Metrics(
            prefill_tokens=len(ids) - reused,
            prefill_tps=(len(ids) - reused) / prefill_s if prefill_s > 0 else 0.0,
            prefill_total=len(ids) - reused,
            reused_tokens=reused,
            kv_max_capacity=model.max_capacity,
            model=self._name,
            device=self._device,
        )
        sampler = Sampler(params, ids)
        detok = self.tokenizer.detokenizer()
        stops = _StopMatcher(params.stop)
        spec = self.speculative
        if spec is not None:
            spec.new_reply()
        generated = 0
        t_first = 0.0
        last_emit = 0.0
        metrics = base

        def current(now: float) -> Metrics:
            decode_s = now - t_first
            m = replace(
                base,
                ttft_s=t_first - t_request,
                decode_tokens=max(0, generated - 1),
                decode_tps=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
                kv_used=model.n_past,
                kv_capacity=model.capacity,
            )
            if spec is None:
                return m
            st = spec.stats
            return replace(
                m,
                drafted=st.drafted,
                accepted=st.accepted,
                mean_accepted_len=st.mean_accepted_len,
                draft_k=st.k,
                draft_time_share=st.draft_time_share,
                draft=spec.name,
            )

        stop: StopReason | None = None
        # `queue`: the next reply tokens; all but the last are accepted drafts already in the cache
        queue = [sampler.sample(logits)]
        now = clock()
        while True:
            for j, token in enumerate(queue):
                generated += 1
                now = clock()
                if generated == 1:
                    t_first = now
                if token in self.stop_ids and not params.ignore_eos:
                    stop = "eos"
                else:
                    text, hit = stops.feed(detok.push(token))
                    yield TokenDelta(text, (token,))
                    if hit:
                        stop = "stop_string"
                    elif generated >= params.max_tokens:
                        stop = "max_tokens"
                if stop is not None:
                    # like plain decoding, the cache ends before the token that stopped the reply
                    extra = len(queue) - 1 - j
                    if extra > 0:
                        del self._tokens[-extra:]
                        model.rollback(len(self._tokens))
                    break
            if stop is not None:
                break
            token = queue[-1]
            if model.n_past + 1 > model.max_capacity:
                stop = "length"
                break
            if now - last_emit >= METRICS_INTERVAL_S:
                last_emit = now
                yield MetricsUpdate(current(now))
            if cancel.is_set():
                break
            if spec is None:
                logits = model.decode(token)
                self._tokens.append(token)
                queue = [sampler.sample(logits)]
            else:
                budget = params.max_tokens - generated
                committed, queue = spec.advance(self._tokens, token, sampler, budget)
                self._tokens.extend(committed)
        # a reply cut short (stopped, or at max_tokens) ends at a character boundary: the
        # bytes of a half-sampled character are dropped, never stored as U+FFFD
        cut = stop is None or stop == "max_tokens"
        tail = stops.flush() + ("" if cut else detok.flush()) if stop != "stop_string" else ""
        if tail:
            yield TokenDelta(tail)
        metrics = current(clock())
        yield MetricsUpdate(metrics)
        if stop is None:
            yield Cancelled(metrics)
        else:
            yield Finished(stop, metrics)
