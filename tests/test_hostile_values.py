"""Hostile values: sampling parameters outside their domain (CLI, the app's settings dialog, the
engine itself), `--seed -1`, broken `[keymap]` entries, and config or theme files that are not
what they should be. Each is refused with one line that says what is allowed, or (keymap,
themes) warned about at start while the default is kept; nothing raises a traceback."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from installed_model import install_as_syn
from scripted_engine import ScriptedEngine, ScriptedReply, make_app, wait_for_chat, wait_until
from synthetic import write_synthetic_gguf
from textual.pilot import Pilot
from textual.widgets import Input, Label

from npuchat.app.cli import main
from npuchat.app.settings import Settings, load_settings
from npuchat.app.store import ConversationStore
from npuchat.app.tui.composer import Composer
from npuchat.app.tui.keymap_check import check_keymap
from npuchat.app.tui.settings_modal import SettingsScreen
from npuchat.engine.errors import NpuchatError
from npuchat.engine.events import ChatMessage, ChatRequest, Failed, SamplingParams
from npuchat.engine.sampler import distribution
from npuchat.engine.sampling_domain import check_sampling
from npuchat.engine.session import ChatSession
from npuchat.themes import user_themes

# ---- sampling values -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def syn_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("m") / "syn.gguf", "llama", seed=5)


@pytest.fixture()
def syn(isolated_home: Path, syn_gguf: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    return install_as_syn(syn_gguf, capsys)


BAD_RUN_VALUES = [
    ("--temperature", "-1"),
    ("--temperature", "nan"),
    ("--temperature", "1e9"),
    ("--top-p", "2"),
    ("--top-p", "0"),
    ("--top-p", "-1"),
    ("--top-p", "nan"),
    ("--top-k", "-5"),
    ("--min-p", "nan"),
    ("--min-p", "2"),
    ("--repeat-penalty", "0"),
    ("--repeat-penalty", "-1"),
    ("--repeat-penalty", "inf"),
    ("--presence-penalty", "2.5"),
    ("--presence-penalty", "nan"),
    ("--frequency-penalty", "-3"),
    ("--seed", "-2"),
    ("--max-tokens", "0"),
    ("--stop", ""),
]


@pytest.mark.parametrize(("flag", "value"), BAD_RUN_VALUES)
def test_run_refuses_sampling_values_outside_their_domain(
    syn: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert main(["run", "--model", "syn", "-p", "hello", "-n", "3", flag, value]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in captured.err
    assert "must be" in lines[0]


def test_seed_minus_one_means_a_random_seed(syn: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--model", "syn", "-p", "hello", "-n", "4", "-t", "1", "--json"]
    assert main([*args, "--seed", "-1"]) == 0
    assert '"metrics"' in capsys.readouterr().out


@pytest.fixture(scope="module")
def session(syn_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatSession]:
    s = ChatSession.open(
        syn_gguf, name="syn", cache_dir=tmp_path_factory.mktemp("c"), capacities=[256]
    )
    yield s
    s.close()


@pytest.mark.parametrize(
    "bad",
    [
        SamplingParams(temperature=math.nan),
        SamplingParams(top_p=0.0),
        SamplingParams(repeat_penalty=0.0),
        SamplingParams(seed=-1),
        SamplingParams(top_k=-5),
        SamplingParams(max_tokens=0),
        SamplingParams(logit_bias=((10**6, 1.0),)),  # beyond the vocabulary
        SamplingParams(logit_bias=((1, 101.0),)),
    ],
)
def test_the_engine_answers_an_out_of_domain_request_as_invalid(
    session: ChatSession, bad: SamplingParams
) -> None:
    request = ChatRequest("c", "", (ChatMessage("user", "hello"),), bad)
    events = list(session.generate(request, threading.Event()))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].kind == "invalid" and "must be" in events[0].message


finite = st.floats(allow_nan=True, allow_infinity=True, width=64)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    temperature=finite,
    top_p=finite,
    min_p=finite,
    repeat_penalty=finite,
    presence_penalty=finite,
    frequency_penalty=finite,
    top_k=st.integers(-10, 10**7),
    logits=st.lists(st.floats(-30, 30), min_size=2, max_size=40),
)
def test_every_accepted_sampling_value_gives_a_probability_distribution(
    temperature: float,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    presence_penalty: float,
    frequency_penalty: float,
    top_k: int,
    logits: list[float],
) -> None:
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        top_k=top_k,
    )
    try:
        check_sampling(params)
    except NpuchatError as exc:
        assert "must be" in str(exc) and "\n" not in str(exc)
        return
    probs = distribution(np.asarray(logits), params, history=[0, 1])
    assert np.all(np.isfinite(probs)) and np.all(probs >= 0)
    assert abs(probs.sum() - 1.0) < 1e-9


# ---- the app's settings dialog ---------------------------------------------------------------


@pytest.fixture()
def store() -> Iterator[ConversationStore]:
    s = ConversationStore.in_memory()
    yield s
    s.close()


async def _send(pilot: Pilot[None], text: str) -> None:
    composer = pilot.app.screen.query_one(Composer)
    composer.focus()
    composer.text = text
    await pilot.press("enter")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("temperature", "nan", "Temperature"),
        ("temperature", "1e9", "Temperature"),
        ("top_p", "nan", "Top-p"),
        ("top_p", "0", "Top-p"),
        ("top_k", "-5", "Top-k"),
        ("seed", "-1", "Seed"),
        ("max_tokens", "0", "Max tokens"),
        ("min_p", "1.5", "Min-p"),
        ("repeat_penalty", "0", "Repeat penalty"),
        ("presence_penalty", "inf", "Presence penalty"),
        ("frequency_penalty", "-3", "Frequency penalty"),
        ("reply_format", "yaml", "Reply format"),
    ],
)
def test_settings_dialog_refuses_values_outside_their_domain(
    store: ConversationStore, field: str, value: str, needle: str
) -> None:
    app = make_app(ScriptedEngine(), store)

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await wait_for_chat(pilot)
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen), "dialog")
            modal = app.screen
            modal.query_one(f"#{field}", Input).value = value
            await pilot.click("#save")
            await pilot.pause(0.1)
            assert app.screen is modal  # not saved
            error = str(modal.query_one("#settings-error", Label).render())
            assert needle in error and "\n" not in error
            await pilot.press("escape")
            await wait_until(pilot, lambda: app.screen is screen, "dialog closed")

    import asyncio

    asyncio.run(run())


# ---- keymap ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keymap", "needle"),
    [
        ({"send": 5}, "give keys as a string"),
        ({"send": "not-a-key"}, "is not a key name"),
        ({"send": ["enter"]}, "give keys as a string"),
        ({"send": ""}, "give keys as a string"),
        ({"send": "ctrl+n"}, "already new_chat's key"),
        ({"regenerate": "enter"}, "already send's key"),
        ({"no_such_binding": "x"}, "no such binding"),
    ],
)
def test_a_bad_keymap_entry_is_warned_about_and_the_default_kept(
    store: ConversationStore, keymap: dict[str, object], needle: str
) -> None:
    engine = ScriptedEngine([ScriptedReply(["Hello."])])
    app = make_app(engine, store, settings=Settings(cursor_blink=False, keymap=keymap))  # type: ignore[arg-type]

    async def run() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for_chat(pilot)
            warnings = [n.message for n in app._notifications]
            assert any(needle in w for w in warnings), warnings
            await _send(pilot, "hi")  # Enter still sends
            await wait_until(pilot, lambda: len(engine.requests) == 1, "Enter to send")

    import asyncio

    asyncio.run(run())


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["send", "stop", "regenerate", "quit", "help", "x"]) | st.text(max_size=8),
        st.none() | st.integers() | st.text(max_size=12) | st.lists(st.text(max_size=3)),
        max_size=6,
    )
)
def test_keymap_check_never_raises_and_returns_only_strings(keymap: dict[str, object]) -> None:
    usable, warnings = check_keymap(keymap)
    assert all(isinstance(v, str) and v for v in usable.values())
    assert set(usable) <= set(keymap)
    assert len(usable) + len(warnings) >= len(keymap)
    assert all("\n" not in w for w in warnings)


# ---- text files and standard input -------------------------------------------------------


def test_binary_system_file_and_invalid_utf8_stdin_are_refused(
    syn: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "system.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    assert main(["run", "--model", "syn", "-p", "hi", "--system-file", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "system.bin" in err and "UTF-8" in err and "Traceback" not in err
    code = (
        "import sys; from npuchat.app.cli import main;"
        " sys.exit(main(['run', '--model', 'syn', '--conversation', 'new', '-n', '2']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=b"caf\xe9\n", capture_output=True, timeout=120
    )
    assert out.returncode == 2
    assert b"UTF-8" in out.stderr and b"Traceback" not in out.stderr


# ---- config and theme files ------------------------------------------------------------------

TOML_BITS = st.sampled_from(
    [
        'model = "x"\n',
        "threads = -3\n",
        "threads = 99999999999999999999\n",
        'device = "gpu"\n',
        "[keymap]\n",
        "send = 5\n",
        "keymap = 3\n",
        "theme = 1.5\n",
        "show_metrics = 1\n",
        "[models.a]\n",
        "= broken\n",
        '"\\ud800" = 1\n',
        "\xff\xfe",
        "\x00",
    ]
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(TOML_BITS | st.text(max_size=20), max_size=6), st.binary(max_size=8))
def test_any_config_file_loads_or_is_one_line_error(
    tmp_path_factory: pytest.TempPathFactory, parts: list[str], noise: bytes
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.toml"
    path.write_bytes("".join(parts).encode("utf-8", "surrogatepass") + noise)
    try:
        loaded = load_settings(path)
    except NpuchatError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc).strip()
        return
    assert isinstance(loaded, Settings)


def test_invalid_utf8_config_is_refused_by_the_cli(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["paths"]) == 0
    capsys.readouterr()
    from npuchat.engine.paths import Paths

    config = Paths.from_env().config_file
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_bytes(b'model = "caf\xe9"\n')
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'name = "t"\nprimary = "#112233"\nluminosity_spread = "abc"\n', "luminosity_spread"),
        (b'name = "t"\nprimary = "#112233"\ntext_alpha = nan\n', "text_alpha"),
        (b'name = "t\xff"\nprimary = "#112233"\n', "UTF-8"),
        (b'name = "t"\nprimary = "#112233"\nvariables = 3\n', "variables"),
        (b"\x00\x01\x02", "not valid TOML"),
    ],
)
def test_a_broken_user_theme_is_one_warning(tmp_path: Path, content: bytes, needle: str) -> None:
    (tmp_path / "bad.toml").write_bytes(content)
    themes, problems = user_themes(tmp_path)
    assert themes == [] and len(problems) == 1
    assert needle in problems[0] and "bad.toml" in problems[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "replace")))
def test_any_theme_file_loads_or_is_one_warning(
    tmp_path_factory: pytest.TempPathFactory, content: bytes
) -> None:
    folder = tmp_path_factory.mktemp("themes")
    (folder / "fuzz.toml").write_bytes(b'name = "f"\nprimary = "#102030"\n' + content)
    themes, problems = user_themes(folder)
    assert len(themes) + len(problems) == 1
