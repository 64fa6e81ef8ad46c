"""The options given before the command (`npuchat --model X serve`) reach the command that has
them, as if given after it; before one that has no use for them, or given twice with different
values, they are a one-line error, never silently dropped (the settings' model would run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomlkit

from npuchat.app.cli import main


@pytest.fixture()
def no_default_model(isolated_home: Path) -> None:
    """Settings whose model does not exist: a command that ignored `--model X` fails on it."""
    cfg = isolated_home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    doc = tomlkit.parse(cfg.read_text()) if cfg.exists() else tomlkit.document()
    doc["model"] = "not-the-one"  # beside what `syn`'s import wrote there
    cfg.write_text(tomlkit.dumps(doc))


def _reply(out: str) -> tuple[list[int], dict]:
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [r["id"] for r in rows[:-1]], rows[-1]


def test_context_reaches_run_and_caps_its_cache(
    syn: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = ["-p", "the fox", "-n", "3", "-t", "0", "--json", "--draft", "none"]
    assert main(["--model", "syn", "--context", "300", "run", *prompt]) == 0
    _, last = _reply(capsys.readouterr().out)
    assert last["metrics"]["kv_max_capacity"] == 300
    assert main(["run", "--model", "syn", "--context", "100000", *prompt]) == 2
    err = capsys.readouterr().err
    assert "a context of 100000 tokens" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["serve", "--context", "lots"], "'lots' is not a number of tokens"),
        (["run", "--context", "100", "-p", "x"], "give 256 to 1048576 tokens"),
    ],
)
def test_a_context_that_is_no_number_of_tokens_is_refused(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_options_before_run_reach_it(
    syn: Path, no_default_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = ["-p", "the fox", "-n", "5", "-t", "0", "--json", "--draft", "none"]
    assert main(["run", "--model", "syn", "--kv-dtype", "f32", *prompt]) == 0
    after, _ = _reply(capsys.readouterr().out)
    assert main(["--model", "syn", "--kv-dtype", "f32", "--device", "cpu", "run", *prompt]) == 0
    before, last = _reply(capsys.readouterr().out)
    assert before == after and len(before) >= 1
    assert last["metrics"]["device"] == "cpu"


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "missing", "run", "-p", "x"],
        ["--model", "missing", "serve", "--port", "0"],
        ["--model", "missing", "bench"],
        ["--model", "missing", "doctor", "--device", "cpu"],
    ],
)
def test_a_model_before_the_command_is_the_one_it_loads(
    args: list[str], no_default_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "'missing'" in err and "not-the-one" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "a", "run", "--model", "b", "-p", "x"], "--model is given twice (a before"),
        (["--draft", "none", "serve", "--draft", "lookup"], "--draft is given twice"),
        (["--model", "syn", "models"], "--model before `models` is not used by it"),
        (["--device", "cpu", "doctor"], "put it after `doctor`, where it names the device"),
        (["--server", "http://127.0.0.1:1", "run", "-p", "x"], "--server before `run`"),
        (["--kv-dtype", "f16", "pull", "x"], "--kv-dtype before `pull`"),
        (["--context", "4096", "bench"], "--context before `bench`"),
        (["--api-key", "k", "serve"], "`npuchat serve --api-key KEY` sets the key clients"),
    ],
)
def test_options_a_command_cannot_take_are_one_line_errors(
    args: list[str], needle: str, no_default_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
