"""config.toml edits keep what the user wrote: comments, order, other keys and tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic import write_synthetic_gguf

from npuchat.app.cli import main
from npuchat.app.settings import load_settings, set_setting
from npuchat.engine.errors import NpuchatError

USER_CONFIG = """\
# my npuchat setup
model = "smollm2-135m"  # small and quick
theme = "npuchat-dark"

[keymap]
regenerate = "ctrl+g"  # my key
"""


def test_set_setting_changes_only_that_key(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(USER_CONFIG)
    set_setting(config, "theme", "npuchat-light")
    set_setting(config, "show_metrics", False)
    text = config.read_text()
    # every comment and other line as it was; a new key goes with the other top-level keys
    new = 'theme = "npuchat-light"\nshow_metrics = false'
    assert text == USER_CONFIG.replace('theme = "npuchat-dark"', new)
    settings = load_settings(config)
    assert (settings.theme, settings.show_metrics, settings.model) == (
        "npuchat-light",
        False,
        "smollm2-135m",
    )


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [("theme", 3, "should be a str"), ("nonsense", 1, "unknown setting"), ("device", "gpu", "gpu")],
)
def test_set_setting_refuses_bad_values(
    tmp_path: Path, name: str, value: object, needle: str
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(USER_CONFIG)
    with pytest.raises(NpuchatError, match=needle):
        set_setting(config, name, value)
    assert config.read_text() == USER_CONFIG


def test_broken_config_is_refused_not_overwritten(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('theme = "unterminated\n')
    with pytest.raises(NpuchatError, match="not valid TOML"):
        set_setting(config, "theme", "npuchat-light")
    assert config.read_text() == 'theme = "unterminated\n'


def test_import_and_rm_keep_the_users_comments(
    tmp_path: Path, isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["paths", "--json"]) == 0
    config = Path(json.loads(capsys.readouterr().out)["config_file"])
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(USER_CONFIG)
    gguf = write_synthetic_gguf(tmp_path / "syn.gguf", "llama", seed=1)
    assert main(["import", str(gguf), "--name", "syn"]) == 0
    assert config.read_text().startswith(USER_CONFIG) and "[models.syn]" in config.read_text()
    assert main(["rm", "syn"]) == 0
    assert "syn" not in config.read_text() and config.read_text().startswith(USER_CONFIG)
