"""`npuchat run`: one-shot generation streamed to stdout, like `ollama run` and `llama-cli -p`.

With `--json` every token is a JSON line (`{"id", "text"}`, with `--logprobs N` its `logprob` and
the N likeliest ids' as `top`) and the last line holds the metrics;
this is the form scripts and our own checks read. `--conversation ID` continues a conversation
saved in the app's database (and saves the new turn), so multi-turn reuse is scriptable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.console import Console

from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
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
)
from npuchat.engine.grammar import ANY_OBJECT
from npuchat.engine.sampling_domain import SAMPLING_FIELDS, check_sampling

from .context import AppContext
from .engine_factory import open_concurrent_engine
from .engine_port import EngineSpec
from .progress import RichPullProgress
from .store import ConversationStore, MessageStatus
from .store_schema import DatabaseBusyError
from .text_safety import escape_controls

if TYPE_CHECKING:
    from .store import MessageStatus

METRIC_FIELDS = (
    "ttft_s",
    "prefill_tokens",
    "prefill_tps",
    "reused_tokens",
    "decode_tokens",
    "decode_tps",
    "kv_used",
    "kv_capacity",
)


_FLAGS = {name: "--" + name.replace("_", "-") for name in SAMPLING_FIELDS}


def metrics_dict(m: Metrics) -> dict[str, object]:
    data = asdict(m)
    return {k: data[k] for k in METRIC_FIELDS} | {
        "kv_max_capacity": m.kv_max_capacity,
        "drafted": m.drafted,
        "accepted": m.accepted,
        "mean_accepted_len": m.mean_accepted_len,
        "draft_k": m.draft_k,
        "draft_time_share": m.draft_time_share,
        "draft": m.draft,
        "model": m.model,
        "device": m.device,
    }


def _system_prompt(args: argparse.Namespace, ctx: AppContext) -> str:
    if args.system_file is not None:
        try:
            return args.system_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise NpuchatError(
                f"--system-file {args.system_file} is not UTF-8 text (byte {exc.start});"
                " give a text file"
            ) from exc
        except OSError as exc:
            raise NpuchatError(f"cannot read --system-file {args.system_file}: {exc}") from exc
    return args.system if args.system is not None else ctx.settings.system_prompt


def _read_stdin() -> str:
    if sys.stdin.isatty():  # waiting on a terminal without a word would look like a hang
        print(
            "npuchat: type the prompt, then Ctrl-D on a line of its own (for a chat: `npuchat`)",
            file=sys.stderr,
        )
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NpuchatError(
            f"standard input is not UTF-8 text (byte {exc.start}); convert it, e.g. with"
            " `iconv -t utf-8`"
        ) from exc


def _prompt(args: argparse.Namespace) -> str:
    """The prompt: the words after `run` (as `ollama run` and `llm` take it), --prompt, or
    standard input; given both ways it is refused rather than one silently dropped."""
    if args.text and args.prompt is not None:
        raise NpuchatError("the prompt is given twice (as text and with --prompt): give it one way")
    if args.text:
        return " ".join(args.text)
    return args.prompt if args.prompt is not None else _read_stdin()


def cmd_run(ctx: AppContext, args: argparse.Namespace) -> int:
    prompt = _prompt(args)
    if not prompt.strip():
        raise NpuchatError(
            "the prompt is empty: give it after `run`, with --prompt TEXT, or on stdin"
        )
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logprobs=args.logprobs,
        json_schema=ANY_OBJECT if args.format == "json" else None,
        seed=None if args.seed == -1 else args.seed,  # -1 = random, as in llama.cpp
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    check_sampling(sampling, _FLAGS)
    if args.logprobs is not None and not args.json:
        raise NpuchatError("--logprobs prints with --json only: add --json")
    model = args.run_model or ctx.settings.model
    device = args.run_device or ctx.settings.device
    store: ConversationStore | None = None
    conversation = None
    history: list[ChatMessage] = []
    if args.conversation:
        store = ConversationStore.open(ctx.paths.database_file)
        if args.conversation == "new":
            conversation = store.create_conversation()
            print(f"conversation {conversation.id}", file=sys.stderr)
        else:
            conversation = store.get_conversation(args.conversation)
            history = [
                ChatMessage(m.role, m.content)
                for m in store.messages(conversation.id)
                if m.role in ("user", "assistant") and m.status != "error"
            ]
    ctx = ctx.with_settings(kv_dtype=args.run_kv_dtype, context=args.run_context)
    engine = open_concurrent_engine(
        ctx,
        EngineSpec(model, ctx.settings.draft if args.run_draft is None else args.run_draft, device),
        pull_progress=RichPullProgress(Console(stderr=True)),
    )
    if device in ("", "auto"):  # say what `auto` chose, and why
        from npuchat.engine.devices import resolve_device

        print(f"npuchat: device {resolve_device(device)[1]}", file=sys.stderr)
    system = _system_prompt(args, ctx)
    messages = (*history, ChatMessage("user", prompt))
    saver = None
    if store is not None and conversation is not None:
        store.add_message(conversation.id, "user", prompt)  # committed before any reply text
        saver = ReplySaver(store, store.add_message(conversation.id, "assistant", "", "partial").id)
    cancel = threading.Event()
    stopped_by: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        cancel.set()

    previous = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    final: Finished | Cancelled | None = None
    try:
        if args.raw:
            ids = engine.tokenizer.encode(
                prompt, parse_special=True, add_bos=engine.tokenizer.add_bos
            )
            events = engine.complete(ids, sampling, cancel)
        else:
            events = engine.generate(
                ChatRequest(conversation.id if conversation else "run", system, messages, sampling),
                cancel,
            )
        escape = not args.no_escape and sys.stdout.isatty()
        _, final = _stream(events, args.json, saver, escape)
    except BaseException as exc:
        if saver is not None:
            saver.finish("error", None, str(exc) or type(exc).__name__)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()
    if saver is not None and final is not None:
        done = final if isinstance(final, Finished) else None
        status: MessageStatus = "complete" if done is not None else "stopped"
        reason = done.stop_reason if done is not None else None
        saver.finish(status, final.metrics, stop_reason=reason, token_limit=sampling.max_tokens)
    if store is not None:
        store.close()
    if args.verbose and final is not None and not args.json:
        m = final.metrics
        print(
            f"\nttft {m.ttft_s:.3f} s · prefill {m.prefill_tokens} tok @ {m.prefill_tps:.1f} tok/s"
            f" (reused {m.reused_tokens}) · decode {m.decode_tokens} tok @ {m.decode_tps:.1f}"
            f" tok/s · kv {m.kv_used}/{m.kv_capacity}"
            + (
                f" · draft {m.draft}: {m.accepted}/{m.drafted} accepted"
                f" ({m.mean_accepted_len:.2f}/round, k {m.draft_k})"
                if m.draft
                else ""
            ),
            file=sys.stderr,
        )
    if stopped_by:
        return 128 + stopped_by[0]
    return 130 if isinstance(final, Cancelled) else 0


_STOP_SIGNALS = tuple(
    s
    for s in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
    if s
)
"""Signals that stop the reply (it is saved as stopped) instead of killing the process."""

SAVE_INTERVAL_S = 0.5
"""A streaming reply is committed at least this often, so a kill -9 loses at most this much."""


class ReplySaver:
    """Commits a streaming reply's text to its row: at most every SAVE_INTERVAL_S, then once
    with its final status. A periodic save that finds the file locked gives up at once (the
    next one catches up); the final one waits for the lock."""

    def __init__(self, store: ConversationStore, message_id: int) -> None:
        self.store = store
        self.message_id = message_id
        self.text = ""
        self._saved_at = time.monotonic()
        self._saved_len = 0

    def update(self, text: str) -> None:
        self.text = text
        if time.monotonic() - self._saved_at >= SAVE_INTERVAL_S and len(text) != self._saved_len:
            with contextlib.suppress(DatabaseBusyError):
                self.store.update_message(
                    self.message_id, content=text, status="partial", deadline_s=0.0
                )
            self._saved_at = time.monotonic()
            self._saved_len = len(text)

    def finish(
        self,
        status: MessageStatus,
        metrics: Metrics | None,
        error: str = "",
        stop_reason: StopReason | None = None,
        token_limit: int = 0,
    ) -> None:
        self.store.update_message(
            self.message_id,
            content=self.text,
            status=status,
            metrics=metrics,
            error=error,
            stop_reason=stop_reason,
            token_limit=token_limit,
        )


def _stream(
    events: Iterable[Event],
    as_json: bool,
    saver: ReplySaver | None = None,
    escape: bool = False,
) -> tuple[str, Finished | Cancelled | None]:
    """Print the reply as it streams; `escape` shows control characters instead of letting
    them act on the terminal (`text_safety`)."""
    reply: list[str] = []
    final: Finished | Cancelled | None = None
    out = sys.stdout
    for ev in events:
        if isinstance(ev, TokenDelta):
            reply.append(ev.text)
            if saver is not None and ev.text:
                saver.update("".join(reply))
            if as_json:
                for i, tid in enumerate(ev.ids):
                    text = ev.text if i == len(ev.ids) - 1 else ""
                    line: dict[str, object] = {"id": tid, "text": text}
                    if i < len(ev.logprobs):  # --logprobs
                        lp = ev.logprobs[i]
                        line["logprob"] = lp.logprob
                        line["top"] = [{"id": t.token, "logprob": t.logprob} for t in lp.top]
                    out.write(json.dumps(line) + "\n")
            else:
                out.write(escape_controls(ev.text) if escape else ev.text)
            out.flush()
        elif isinstance(ev, MetricsUpdate):
            if saver is not None:
                saver.update("".join(reply))
        elif isinstance(ev, Notice):
            print(f"npuchat: {escape_controls(ev.text)}", file=sys.stderr)
        elif isinstance(ev, Failed):
            raise NpuchatError(ev.message)
        elif isinstance(ev, (Finished, Cancelled)):
            final = ev
    if final is not None:
        if as_json:
            stop = final.stop_reason if isinstance(final, Finished) else "cancelled"
            out.write(json.dumps({"metrics": metrics_dict(final.metrics), "stop": stop}) + "\n")
        elif reply and not "".join(reply).endswith("\n"):
            out.write("\n")
    return "".join(reply), final
