"""API keys kept out of the command line: `--api-key-file` (several keys, one a line) and
`NPUCHAT_API_KEY`, for `npuchat serve` and for the app's `--server` client."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from npuchat.app import api_keys as keys_mod
from npuchat.app import openai_engine
from npuchat.app.api_keys import api_keys, read_key_file
from npuchat.app.cli import main
from npuchat.app.serve import command
from npuchat.engine.errors import NpuchatError
from tests.scripted_engine import ScriptedEngine, ScriptedReply
from tests.serve_helpers import serving


def _key_file(tmp_path: Path, text: str | bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    path.chmod(mode)
    return path


def test_a_key_file_holds_one_key_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _key_file(tmp_path, "# laptop\nalpha-1\n\n  beta_2  \r\n# old: gamma\n")
    assert read_key_file(str(path)) == ("alpha-1", "beta_2")
    assert capsys.readouterr().err == ""


def test_a_key_file_others_can_read_is_used_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _key_file(tmp_path, "alpha\n", mode=0o644)
    assert read_key_file(str(path)) == ("alpha",)
    err = capsys.readouterr().err
    assert "can be read by other users" in err and "chmod 600" in err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("", "holds no key"),
        ("# only a comment\n\n", "holds no key"),
        ("two words\n", "printable ASCII without spaces"),
        ("k\x1b[31m\n", "printable ASCII without spaces"),
        ("clé\n", "printable ASCII without spaces"),
        (b"\xff\xfe\x00k", "not UTF-8"),
        ("k" * 2000, "at most 1,024"),
        ("k\n" * 40_000, "over 64 KiB"),
    ],
)
def test_a_bad_key_file_is_a_one_line_error(
    tmp_path: Path, content: str | bytes, says: str
) -> None:
    path = _key_file(tmp_path, content)
    with pytest.raises(NpuchatError, match=says) as info:
        read_key_file(str(path))
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_missing_file_or_a_folder_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(NpuchatError, match="give a readable file"):
        read_key_file(str(tmp_path / "absent"))
    with pytest.raises(NpuchatError, match="give a readable file"):
        read_key_file(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: reading it would wait for ever
    with pytest.raises(NpuchatError, match="not a file"):
        read_key_file(str(fifo))


def test_the_flag_then_the_file_then_the_environment(tmp_path: Path) -> None:
    path = _key_file(tmp_path, "from-file\n")
    env = {keys_mod.ENV_VAR: " from-env \n"}
    assert api_keys("from-flag", None, env) == ("from-flag",)
    assert api_keys(None, str(path), env) == ("from-file",)
    assert api_keys(None, None, env) == ("from-env",)
    assert api_keys(None, None, {keys_mod.ENV_VAR: ""}) == ()
    assert api_keys(None, None, {"OPENAI_API_KEY": "sk-not-for-us"}) == ()
    with pytest.raises(NpuchatError, match="not both"):
        api_keys("a", str(path), {})
    with pytest.raises(NpuchatError, match=keys_mod.ENV_VAR):
        api_keys(None, None, {keys_mod.ENV_VAR: "has space"})


def test_every_key_of_the_file_opens_the_server_and_no_other() -> None:
    engine = ScriptedEngine([ScriptedReply(["a"]), ScriptedReply(["b"])])
    with serving(engine, api_keys=("alpha", "beta")) as (server, _):

        def status(key: str) -> int:
            auth = {"Authorization": f"Bearer {key}"}
            return httpx.get(server.url + "/v1/models", headers=auth).status_code

        assert status("alpha") == 200 and status("beta") == 200
        assert status("gamma") == 401 and status("alphabeta") == 401 and status("alph") == 401


def test_serve_beyond_loopback_takes_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With NPUCHAT_API_KEY set, `--host 0.0.0.0` passes the key rule and goes on to load the
    model (stopped there); without it, the rule refuses before anything loads."""
    opened: list[str] = []

    def no_model(*args: object, **kw: object) -> None:
        opened.append("engine")
        raise NpuchatError("stopped before loading")

    monkeypatch.setattr(command, "open_concurrent_engine", no_model)
    monkeypatch.delenv(keys_mod.ENV_VAR, raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--api-key-file" in capsys.readouterr().err and not opened
    monkeypatch.setenv(keys_mod.ENV_VAR, "s3cret")
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "stopped before loading" in capsys.readouterr().err and opened == ["engine"]


def test_key_options_that_cannot_be_used_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _key_file(tmp_path, "k\n")
    with pytest.raises(SystemExit) as both:
        main(["serve", "--api-key", "k", "--api-key-file", str(path)])
    assert both.value.code == 2 and "not allowed with" in capsys.readouterr().err
    assert main(["--api-key-file", str(path)]) == 2  # the app on a local model: no server
    assert "give the server too" in capsys.readouterr().err
    assert main(["--api-key-file", str(path), "serve"]) == 2
    assert "npuchat serve --api-key-file FILE" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--api-key-file", str(tmp_path / "none")]) == 2
    assert "give a readable file" in capsys.readouterr().err


def test_the_app_sends_the_file_s_first_key_or_the_environment_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sent: list[str | None] = []

    def loader(url: str, api_key: str | None, model: str | None) -> None:
        sent.append(api_key)
        raise NpuchatError("stopped before the screen")

    monkeypatch.setattr(openai_engine, "remote_loader", loader)
    monkeypatch.setenv(keys_mod.ENV_VAR, "from-env")
    path = _key_file(tmp_path, "first\nsecond\n")
    assert main(["--server", "http://127.0.0.1:9", "--api-key-file", str(path)]) == 2
    assert main(["--server", "http://127.0.0.1:9"]) == 2
    monkeypatch.delenv(keys_mod.ENV_VAR)
    assert main(["--server", "http://127.0.0.1:9"]) == 2
    assert sent == ["first", "from-env", None]
    assert capsys.readouterr().err.count("stopped before the screen") == 3
