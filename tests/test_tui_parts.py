"""Unit tests of the TUI's non-widget parts: themes, reply buffer, requests, keys, formats."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine, ScriptedReply
from textual.color import Color

from npuchat.app.store_records import ConversationSettings, StoredMessage
from npuchat.app.tui.formatting import acceptance, kv_text, reply_summary, seconds, when
from npuchat.app.tui.generation import ReplyBuffer, build_request, run_generation, thin
from npuchat.app.tui.help_screen import key_label
from npuchat.app.tui.keys import (
    DIALOG_IDS,
    KEYS,
    bindings,
    effective_keys,
    unknown_keymap_ids,
)
from npuchat.app.tui.loader_worker import ProgressThrottle
from npuchat.app.tui.titles import clean_title
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import (
    Cancelled,
    ChatMessage,
    ChatRequest,
    Failed,
    Finished,
    Metrics,
    MetricsUpdate,
    Notice,
    TokenDelta,
)
from npuchat.themes import (
    THEME_VARIABLE_DEFAULTS,
    builtin_themes,
    load_theme_file,
    resolve_references,
    user_themes,
)

# ---- themes ------------------------------------------------------------------------------------


def test_builtin_themes_load_with_all_npuchat_variables() -> None:
    themes = {t.name: t for t in builtin_themes()}
    assert {"npuchat-dark", "npuchat-light"} <= set(themes)
    assert themes["npuchat-dark"].dark and not themes["npuchat-light"].dark
    for theme in themes.values():
        missing = set(THEME_VARIABLE_DEFAULTS) - set(theme.variables)
        assert not missing, f"{theme.name} lacks {missing}"
        for value in theme.variables.values():
            Color.parse(value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('primary = "#fff"\n', "needs a name"),
        ('name = "x"\n', "needs a primary"),
        ('name = "x"\nprimary = "notacolour"\n', "is not a colour"),
        ('name = "x"\nprimary = "#fff"\nsparkle = 1\n', "unknown keys sparkle"),
        ('name = "x"\nprimary = "#fff"\ndark = "yes"\n', "dark must be true or false"),
        ('name = "x"\nprimary = "#fff"\n[variables]\na = 1\n', "[variables] must map"),
        ("name = \n", "not valid TOML"),
    ],
)
def test_bad_theme_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(NpuchatError) as info:
        load_theme_file(path)
    assert message in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_user_themes_skip_broken_files(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('name = "a"\nprimary = "#123456"\n[variables]\nx = "#fff"\n')
    (tmp_path / "b.toml").write_text("nonsense = \n")
    themes, problems = user_themes(tmp_path)
    assert [t.name for t in themes] == ["a"] and themes[0].variables == {"x": "#fff"}
    assert len(problems) == 1 and "b.toml" in problems[0]
    assert user_themes(tmp_path / "missing") == ([], [])


def test_resolve_references_follows_chains_and_leaves_cycles() -> None:
    out = resolve_references({"a": "#111111", "b": "$a", "c": "$b", "x": "$y", "y": "$x"})
    assert out["b"] == out["c"] == "#111111"
    assert out["x"] == "$y" and out["y"] == "$x"


# ---- reply buffer and requests -------------------------------------------------------------


def test_reply_buffer_coalesces_and_derives_instant_rates() -> None:
    buf = ReplyBuffer()
    buf.push(TokenDelta("a"))
    buf.push(MetricsUpdate(Metrics(decode_tokens=0)))  # no decode yet: no rate point
    buf.push(TokenDelta("b"))
    buf.push(MetricsUpdate(Metrics(decode_tokens=10, decode_tps=10.0)))  # 1.0 s so far
    buf.push(Notice("n"))
    first = buf.drain()
    assert first.text == "ab" and first.metrics == Metrics(decode_tokens=10, decode_tps=10.0)
    assert first.rates == [10.0] and [n.text for n in first.notices] == ["n"]
    assert first.terminal is None
    # 30 tokens in 1.5 s total -> 20 tokens in the last 0.5 s -> 40 tok/s.
    buf.push(MetricsUpdate(Metrics(decode_tokens=30, decode_tps=20.0)))
    final = Metrics(decode_tokens=30, decode_tps=20.0, ttft_s=0.1)
    buf.push(Finished("eos", final))
    buf.push(Failed("ignored: only the first terminal event counts"))
    second = buf.drain()
    assert second.rates == pytest.approx([40.0])
    assert second.terminal == Finished("eos", final) and second.metrics == final
    assert buf.drain().text == "" and buf.drain().terminal is None


def test_thin_keeps_the_newest_half_and_bounds_length() -> None:
    points = [float(i) for i in range(1000)]
    out = thin(points, limit=512)
    assert len(out) < 1000 and out[-500:] == points[-500:]
    assert out[0] == pytest.approx(0.5)
    assert thin([1.0, 2.0], limit=512) == [1.0, 2.0]


def _msg(i: int, role: str, content: str) -> StoredMessage:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return StoredMessage(i, "c", role, content, "complete", now)  # type: ignore[arg-type]


def test_build_request_maps_settings_and_skips_empty_replies() -> None:
    settings = ConversationSettings(
        system_prompt="S", temperature=0.0, top_p=0.5, top_k=3, max_tokens=9, seed=1
    )
    history = [_msg(1, "user", "q1"), _msg(2, "assistant", " "), _msg(3, "user", "q2")]
    request = build_request("c", settings, history)
    assert request.system_prompt == "S" and request.conversation_id == "c"
    assert request.messages == (ChatMessage("user", "q1"), ChatMessage("user", "q2"))
    s = request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.seed) == (0.0, 0.5, 3, 9, 1)


def test_run_generation_always_ends_with_a_terminal_event() -> None:
    request = ChatRequest("c", "", (ChatMessage("user", "hi"),))

    class Silent(ScriptedEngine):
        def generate(self, request, cancel):  # type: ignore[no-untyped-def]
            yield TokenDelta("x")  # ...and stops without a terminal event

    class Crashing(ScriptedEngine):
        def generate(self, request, cancel):  # type: ignore[no-untyped-def]
            yield TokenDelta("x")
            raise RuntimeError("boom")

    for engine, expected in ((Silent(), "without saying why"), (Crashing(), "RuntimeError")):
        buf = ReplyBuffer()
        run_generation(engine, request, threading.Event(), buf)
        drained = buf.drain()
        assert isinstance(drained.terminal, Failed) and expected in drained.terminal.message

    cancel = threading.Event()
    cancel.set()
    buf = ReplyBuffer()
    run_generation(ScriptedEngine([ScriptedReply(["a", "b"])]), request, cancel, buf)
    assert isinstance(buf.drain().terminal, Cancelled)


# ---- keys, formatting, progress ------------------------------------------------------------


def test_every_binding_has_an_id_and_keymap_applies() -> None:
    for spec_id, spec in KEYS.items():
        (binding,) = bindings(spec_id)
        assert binding.id == spec_id and binding.key == spec.key
    assert unknown_keymap_ids({"regenerate": "x", "nope": "y", "help_close": "z"}) == ["nope"]
    rows = {row[3]: row[1] for row in effective_keys({"regenerate": "ctrl+g"})}
    assert rows["regenerate"] == "ctrl+g" and rows["stop"] == "escape"
    assert key_label("shift+enter,ctrl+j") == "Shift+Enter / Ctrl+J"


def test_dialog_binding_ids_are_the_ones_the_dialogs_define() -> None:
    from npuchat.app.tui.dialogs import ConfirmScreen, PromptScreen
    from npuchat.app.tui.help_screen import HelpScreen
    from npuchat.app.tui.loading_screen import LoadingScreen
    from npuchat.app.tui.settings_modal import SettingsScreen

    screens = (ConfirmScreen, PromptScreen, HelpScreen, LoadingScreen, SettingsScreen)
    defined = {b.id for cls in screens for b in cls.BINDINGS}  # type: ignore[union-attr]
    assert defined == DIALOG_IDS


def test_formatting() -> None:
    assert seconds(0.25) == "250 ms" and seconds(1.5) == "1.50 s" and seconds(0) == "–"
    m = Metrics(ttft_s=0.5, decode_tokens=9, decode_tps=12.25, drafted=8, accepted=6, draft_k=4)
    assert reply_summary(m) == "TTFT 500 ms · 12.2 tok/s · 10 tok"
    assert acceptance(m) == "75% (k=4)" and acceptance(Metrics()) == "–"
    assert kv_text(Metrics(kv_used=5, kv_capacity=1024, kv_max_capacity=4096)) == (
        "5 / 1,024 (max 4,096)"
    )
    now = datetime(2026, 3, 14, 15, 0, tzinfo=UTC)
    assert when(datetime(2026, 3, 14, 9, 5, tzinfo=UTC), now) == "09:05"
    assert when(datetime(2026, 1, 2, tzinfo=UTC), now) == "Jan 02"
    assert when(datetime(2025, 1, 2, tzinfo=UTC), now) == "2025-01-02"


def test_progress_throttle_forwards_stage_changes_and_completion() -> None:
    posted: list[tuple[str, float]] = []
    t = [0.0]
    throttle = ProgressThrottle(
        lambda m: posted.append((m.stage, m.fraction)), interval=0.1, clock=lambda: t[0]
    )
    throttle("Downloading", 0.1)
    throttle("Downloading", 0.2)  # same stage, too soon: dropped
    t[0] = 0.2
    throttle("Downloading", 0.3)
    throttle("Compiling", 1.5)  # new stage, clamped
    throttle("Compiling", 1.0)  # completion always goes through
    assert posted == [
        ("Downloading", 0.1),
        ("Downloading", 0.3),
        ("Compiling", 1.0),
        ("Compiling", 1.0),
    ]


def test_clean_title_keeps_one_plain_line() -> None:
    assert clean_title('  "Rust lifetimes explained."\nMore text') == "Rust lifetimes explained"
    assert clean_title("Title: **Binary search**") == "Binary search"
    assert clean_title("## Sorting   in   Go") == "Sorting in Go"
    assert clean_title("\n \n") == ""
    assert clean_title('Here\'s a possible title:\n\n"Reversing strings"') == "Reversing strings"
    assert clean_title("Here's a possible title:") == ""
    long = clean_title("word " * 40)
    assert len(long) == 60 and long.endswith("…")


def test_emoji_are_shown_in_parts_every_terminal_draws_alike() -> None:
    from rich.cells import cell_len

    from npuchat.app.tui.display_text import for_terminal

    text = "ok 👍🏽 👨\u200d👩\u200d👧 ❤️ 🏳️\u200d🌈 done"
    shown = for_terminal(text)
    # A terminal that draws code point by code point and Rich (grapheme by grapheme) agree.
    assert cell_len(shown) == sum(cell_len(ch) for ch in shown)
    assert cell_len(text) != sum(cell_len(ch) for ch in text)  # they did not before
    assert shown == "ok 👍 👨👩👧 ❤ 🏳🌈 done"
