"""Conversation sessions: the `ChatEngine` the UI and `npuchat run` talk to.

A `ChatSession` owns one loaded model and remembers which tokens' K/V are in its cache. Each
request is rendered with the model's chat template and tokenized in full; the longest common
prefix with the cache (or with a stored prefix: see `prefix_store`) is reused and only the rest
is prefilled. Multi-turn chats therefore prefill just the new message, and edits or regenerations
roll back to the point where the token sequences diverge.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path

from .chat_template import ChatTemplate
from .cost_memory import recall_or_measure
from .cpu_info import machine_identity
from .drafters import Drafter
from .errors import InvalidRequestError, NpuchatError, PromptTooLongError, RequestCancelled
from .events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Event,
    Failed,
    Metrics,
    Notice,
    SamplingParams,
    ToolSpec,
)
from .grammar import constraint_for, later_constraints
from .model import Model
from .peer_prefix import RowPeers
from .prefix_store import PrefixStore
from .prompts import PromptBuilder
from .reply import prefill_prompt, stream_reply
from .sampling_domain import sampling_problems
from .sequence import Sequence
from .session_options import MIN_PREFIX_BUDGET, SessionOptions
from .speculative import SpeculativeDecoder
from .tokenizer import Tokenizer, cache_path

log = logging.getLogger(__name__)


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
        costs_dir: Path | None = None,
    ) -> None:
        self.model = model
        self._costs_dir = costs_dir  # the cost model's start figures (`cost_memory`)
        self.tokenizer = tokenizer
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
        self.seq = Sequence(model, 0)  # the tokens whose K/V are in the cache
        self.speculative: SpeculativeDecoder | None = None  # see use_drafters
        self.prompts = PromptBuilder(template, tokenizer, name)
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
        try:  # from the model's open file: parsing the GGUF again cost ~0.3 s on a 150k vocab
            tokenizer = Tokenizer.from_gguf(model.gguf, cache_path(cache_dir, model.sha256))
            template = ChatTemplate.from_gguf(model.gguf)
        except BaseException:
            model.close()
            raise
        return cls(
            model,
            tokenizer,
            template,
            name=name,
            device=device,
            prefix_dir=cache_dir / "prefixes",
            options=options,
            costs_dir=cache_dir / "speculation",
        )

    # ChatEngine protocol
    @property
    def model_name(self) -> str:
        return self._name

    @property
    def draft_name(self) -> str:
        return self.speculative.name if self.speculative is not None else ""

    def use_drafters(self, drafters: Seq[Drafter], **kw: object) -> None:
        """Decode speculatively with these drafters (tried in order each round); none: plain.

        The decoder's cost model is calibrated here (a decode and a few verify widths timed),
        so even the first reply chooses k from measured costs.
        """
        if self.speculative is not None:
            self.speculative.close()
        self.speculative = self.make_decoder(drafters, **kw) if drafters else None

    def make_decoder(self, drafters: Seq[Drafter], **kw: object) -> SpeculativeDecoder:
        """A speculative decoder over this session's model, its cost model calibrated (or
        given what the last start on this machine measured: `cost_memory`)."""
        decoder = SpeculativeDecoder(self.model, drafters, **kw)  # type: ignore[arg-type]
        m = self.model
        key = f"{m.graph_dir.name} threads={m.threads} k={decoder.max_k} {machine_identity()}"
        recall_or_measure(decoder.costs, self._costs_dir, key, lambda: decoder.calibrate(self.seq))
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
        return list(self.seq.tokens)

    def _keep_warm(self, interval: float) -> None:
        """Touch every weight once per idle interval (see SessionOptions.keep_warm_s)."""
        while not self._closed.wait(interval / 2):
            if self._clock() - self._last_used < interval or not self._lock.acquire(False):
                continue
            try:
                seq = self.seq
                n = seq.n_past
                if not self._closed.is_set() and 0 < n < seq.max_capacity:
                    seq.decode(seq.tokens[-1])  # writes slot n only; rolled back below
                    seq.rollback(n)
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

    @property
    def template(self) -> ChatTemplate:
        return self.prompts.template

    @template.setter
    def template(self, template: ChatTemplate) -> None:
        self.prompts.template = template

    def prompt_ids(
        self,
        system: str,
        messages: Seq[ChatMessage],
        tools: Seq[ToolSpec] = (),
        continue_reply: bool = False,
    ) -> list[int]:
        """The prompt ids of a conversation (`PromptBuilder.ids`)."""
        return self.prompts.ids(system, messages, tools, continue_reply)

    def system_prefix(self, system: str) -> list[int]:
        """Tokens every conversation with this system prompt starts with."""
        return self.prompts.system_prefix(system)

    # ------------------------------------------------------------------ KV reuse

    def _remember_system(self, seq: Sequence, system: str, ids: list[int]) -> None:
        prefix = self.system_prefix(system)
        if prefix and ids[: len(prefix)] == prefix and len(seq.tokens) >= len(prefix):
            self.prefixes.put(prefix, seq.kv_export, pinned=True)
            self.prefixes.persist(prefix, seq.kv_export)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        request: ChatRequest,
        cancel: threading.Event,
        *,
        sampling: SamplingParams | None = None,
    ) -> Iterator[Event]:
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
            yield from self.generate_on(self.seq, request, cancel, sampling=sampling)
        finally:
            self._last_used = self._clock()
            self._lock.release()
            with self._state:
                self._generating = False

    def generate_on(
        self,
        seq: Sequence,
        request: ChatRequest | list[int],
        cancel: threading.Event,
        *,
        sampling: SamplingParams | None = None,
        speculate: Callable[[], bool] | None = None,
        store_lock: AbstractContextManager[object] | None = None,
        t_request: float | None = None,
        peers: RowPeers | None = None,
    ) -> Iterator[Event]:
        """One reply on `seq` (this session's own, or a KV slot of the concurrent engine).

        `speculate` says, before each step, whether speculative decoding may run (the
        concurrent engine: only while this sequence runs alone); `store_lock` guards the prefix
        store when several replies run at once; `t_request` is when the request arrived (TTFT
        counts from there; default now); `peers`: the cache's other rows, whose K/V the prompt
        may copy (`peer_prefix`).
        """
        params = sampling if sampling is not None else getattr(request, "sampling", None)
        vocab = self.model.config.vocab_size
        problems = sampling_problems(params, vocab) if params is not None else []
        if problems:
            yield Failed("; ".join(f"{name} {why}" for name, why in problems), kind="invalid")
            return
        t0 = self._clock() if t_request is None else t_request
        try:
            yield from self._generate(
                seq, request, cancel, sampling, speculate, store_lock, t0, peers
            )
        except RequestCancelled:
            yield Cancelled(Metrics(model=self._name, device=self._device))
        except PromptTooLongError as exc:
            yield Failed(str(exc), "invalid", too_long=(exc.prompt_tokens, exc.context))
        except NpuchatError as exc:
            yield Failed(str(exc), "invalid" if isinstance(exc, InvalidRequestError) else "error")
        except Exception as exc:  # a bug: keep the traceback in the log, not on screen
            log.exception("generation failed")
            yield Failed(f"internal error: {type(exc).__name__}: {exc}")

    def complete(
        self, ids: Seq[int], sampling: SamplingParams, cancel: threading.Event
    ) -> Iterator[Event]:
        """Continue raw prompt ids (no chat template): `npuchat run --raw`, benchmarks."""
        ids = list(ids)
        if not ids:
            yield Failed("the prompt is empty", "invalid")
            return
        yield from self.generate(ids, cancel, sampling=sampling)  # type: ignore[arg-type]

    def _generate(
        self,
        seq: Sequence,
        request: ChatRequest | list[int],
        cancel: threading.Event,
        sampling: SamplingParams | None,
        speculate: Callable[[], bool] | None,
        store_lock: AbstractContextManager[object] | None,
        t_request: float,
        peers: RowPeers | None = None,
    ) -> Iterator[Event]:
        clock = self._clock
        if isinstance(request, ChatRequest):
            params = request.sampling
            system = request.system_prompt
            ids, dropped = self.prompts.fit(request, self.model.max_capacity)
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
            self.prompts.check_raw(ids, self.model.max_capacity)  # a chat's are fitted instead
        shape = constraint_for(self.tokenizer, params.json_schema, params.grammar)
        lazy, starts = later_constraints(self.tokenizer, params) if shape is None else (None, [])
        store = store_lock or contextlib.nullcontext()
        if peers is not None:
            peers.claim(ids, cancel)
        try:
            with store:
                peer = partial(peers.best, ids) if peers is not None else None
                reused, _source = self.prefixes.restore(seq, ids, peer)
                warnings = list(self.prefixes.warnings)
                self.prefixes.warnings.clear()
            for warning in warnings:
                yield Notice(warning, "warning")
            t_prefill = clock()
            progress = Metrics(reused_tokens=reused, model=self._name, device=self._device)
            logits = yield from prefill_prompt(seq, ids[reused:], progress, clock)
        finally:
            if peers is not None:
                peers.release()
        prefill_s = clock() - t_prefill
        if system is not None:
            with store:
                self._remember_system(seq, system, ids)

        yield from stream_reply(
            seq,
            logits,
            ids=ids,
            reused=reused,
            params=params,
            prefill_s=prefill_s,
            t_request=t_request,
            cancel=cancel,
            detok=self.tokenizer.detokenizer(),
            stop_ids=self.stop_ids,
            speculative=self.speculative,
            speculate=speculate,
            metrics=Metrics(model=self._name, device=self._device),
            shape=shape,
            clock=clock,
            lazy=lazy,
            starts=starts,
        )
