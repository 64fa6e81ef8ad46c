"""`npuchat bench` end to end on an imported synthetic model: every figure present and sane,
llama-bench ratios next to ours, Ctrl+C keeps what was measured, the README section."""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

import gguf as gguf_lib
import pytest
from synthetic import write_synthetic_gguf

from npuchat.app import bench_command
from npuchat.app.cli import main
from npuchat.engine import bench, bench_suites
from npuchat.engine.gguf_reader import GGUFFile

# llama-bench's `-o json` rows (llama.cpp tools/llama-bench): one object per test, with the
# fields we read plus a few of the others it prints, so the parser meets the real shape.
FAKE_LLAMA_BENCH = """\
#!{python}
import json, sys
args = sys.argv[1:]
def opt(name, default):
    return args[args.index(name) + 1] if name in args else default
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
model, threads = opt("-m", ""), int(opt("-t", "4"))
rows = []
def row(n_prompt, n_gen, depth, ts):
    rows.append({{
        "build_commit": "fake", "build_number": 1, "cpu_info": "test", "gpu_info": "",
        "backends": "CPU", "model_filename": model, "model_type": "llama ?B Q8_0",
        "model_size": 1, "model_n_params": 1, "n_batch": 2048, "n_ubatch": 512,
        "n_threads": threads, "type_k": "f16", "type_v": "f16", "n_gpu_layers": 0,
        "use_mmap": True, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth,
        "test_time": "2025-01-01T00:00:00Z", "avg_ns": 1, "stddev_ns": 0,
        "avg_ts": ts, "stddev_ts": 0.5, "samples_ns": [1], "samples_ts": [ts],
    }})
depths = [int(d) for d in opt("-d", "0").split(",")]
for depth in depths:
    for p in [int(x) for x in opt("-p", "512").split(",") if int(x)]:
        row(p, 0, depth, 1000.0 + p)
    if int(opt("-n", "128")):
        row(0, int(opt("-n", "128")), depth, 50.0 + depth / 100)
print(json.dumps(rows, indent=2))
"""


def _figures(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every Figure (median/min/max/n) anywhere in the report."""
    if isinstance(node, dict):
        if set(node) == {"median", "min", "max", "n"}:
            yield path, node
            return
        for key, value in node.items():
            yield from _figures(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _figures(value, f"{path}[{i}]")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `bench --suite quick --json F --llama-bench FAKE` run, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("NPUCHAT_HOME", str(tmp / "home"))
    mp.setenv("COLUMNS", "200")  # rich would wrap the ratio columns at 80
    try:
        gguf = write_synthetic_gguf(tmp / "syn.gguf", "llama", seed=5, context_length=2048)
        assert main(["import", str(gguf), "--name", "syn"]) == 0
        # same vocabulary, other weights: a draft model for the speculation figures
        draft = write_synthetic_gguf(tmp / "draft.gguf", "llama", seed=9, context_length=2048)
        assert main(["import", str(draft), "--name", "syn-draft"]) == 0
        log = tmp / "llama-calls.jsonl"
        fake = tmp / "llama-bench"
        fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, log=str(log)))
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
        out = tmp / "report.json"
        args = ["bench", "--model", "syn", "--draft", "syn-draft+lookup", "--suite", "quick"]
        args += ["--threads", "1"]
        capture = tmp / "stdout.txt"
        with capture.open("w") as f, pytest.MonkeyPatch.context() as m2:
            m2.setattr(sys, "stdout", f)
            t = perf_counter()
            rc = main([*args, "--json", str(out), "--llama-bench", str(fake)])
            seconds = perf_counter() - t
        return {
            "rc": rc,
            "seconds": seconds,
            "report": json.loads(out.read_text()),
            "stdout": capture.read_text(),
            "calls": [json.loads(line) for line in log.read_text().splitlines()],
            "gguf": gguf,
            "json": out,
        }
    finally:
        mp.undo()


def test_quick_suite_completes_fast(quick_run: dict[str, Any]) -> None:
    assert quick_run["rc"] == 0
    assert quick_run["seconds"] < 60  # ~20 s on 2 loaded cores; most of it is child processes


def test_every_figure_is_sane(quick_run: dict[str, Any]) -> None:
    report = quick_run["report"]
    figures = dict(_figures(report))
    assert len(figures) >= 20
    for path, f in figures.items():
        assert f["min"] > 0, path
        assert f["min"] <= f["median"] <= f["max"], path
        assert f["n"] >= 1, path
    suite = bench_suites.SUITES["quick"]
    assert not report["interrupted"] and report["skipped"] == []
    assert [r["tokens"] for r in report["prefill"]] == list(suite.prefill_sizes)
    assert [r["context"] for r in report["decode"]] == list(suite.decode_contexts)
    for row in report["prefill"]:
        assert row["tps"]["n"] == suite.repeats
        # tok/s and ms are two views of the same runs (odd n: the median run is the same one)
        assert row["tps"]["median"] == pytest.approx(row["tokens"] / row["ms"]["median"] * 1e3)
    for row in report["decode"]:
        assert row["capacity"] >= row["context"] + row["tokens"]
    # several streams in one step: the ratio is against the one-stream row of the same run
    assert [r["streams"] for r in report["batched"]] == list(bench_suites.BATCHED_STREAMS)
    assert report["batched"][0]["ratio"] == 1.0
    for row in report["batched"][1:]:
        assert row["ratio"] == pytest.approx(
            row["tps"]["median"] / report["batched"][0]["tps"]["median"]
        )
    start = report["start"]
    assert start["cold_graph_builds"] >= 1 and start["cached_graph_builds"] == 0
    assert start["cached_s"]["n"] == suite.start_repeats
    assert start["cached_process_s"]["median"] > start["cached_s"]["median"]
    for key in ("ttft_s", "total_tps"):
        assert report["chat"][key]["n"] == suite.repeats * len(suite.prompts)
    assert report["chat"]["reply_tokens_mean"] == suite.reply_tokens  # EOS ignored


def test_memory_figures_match_the_model(quick_run: dict[str, Any]) -> None:
    mem = quick_run["report"]["memory"]
    gguf: Path = quick_run["gguf"]
    assert mem["weight_bytes"] == gguf.stat().st_size
    with GGUFFile(gguf) as g:
        cfg = g.config
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # K and V values per token
    width = {"f16": 2, "f32": 4}[mem["kv_dtype"]]  # the app's "auto": f16 with native kernels
    assert mem["kv_bytes_per_token"] == width * per_token
    for cap, nbytes in mem["kv_bytes_by_capacity"].items():
        assert nbytes == int(cap) * mem["kv_bytes_per_token"]
    assert max(int(c) for c in mem["kv_bytes_by_capacity"]) == cfg.context_length
    assert mem["peak_rss_bytes"]["median"] > mem["weight_bytes"]
    assert mem["suite_peak_rss_bytes"] > 0
    tensors = sum(int(t.n_bytes) for t in gguf_lib.GGUFReader(gguf).tensors)
    assert mem["tensor_bytes"] == tensors and mem["context_binary_bytes"] is None  # CPU run
    assert mem["kv_bytes_in_use"] % mem["kv_bytes_per_token"] == 0
    in_use = next(line for line in quick_run["stdout"].splitlines() if "KV in use (MiB)" in line)
    assert f"{mem['kv_bytes_in_use'] / 2**20:.1f}" in in_use


def test_memory_figures_of_an_int8_cache(tmp_path: Path) -> None:
    """`bench --kv-dtype int8`: the start processes load the int8 cache, so its figures are
    int8's (a byte per value plus a float32 scale per token and head), shown in the table."""
    from rich.console import Console

    from npuchat.app.bench_render import render

    gguf = write_synthetic_gguf(tmp_path / "syn.gguf", "llama", seed=5, context_length=2048)
    suite = bench_suites.SUITES["quick"]
    run = bench.BenchRun(
        suite, gguf=gguf, name="syn", device="cpu", threads=1, cache_dir=tmp_path, kv_dtype="int8"
    )
    run.measure_start()
    mem = run.report.memory
    assert mem is not None
    with GGUFFile(gguf) as g:
        cfg = g.config
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 4)
    assert (mem.kv_dtype, mem.kv_bytes_per_token) == ("int8", per_token)
    in_use = mem.kv_bytes_in_use  # the capacity a 512-token prompt moved the cache to
    assert in_use in mem.kv_bytes_by_capacity.values() and in_use >= 512 * per_token
    console = Console(width=200, record=True)
    console.print(render(run.report))
    rows = console.export_text().splitlines()
    assert any("KV bytes per token" in r and f"{per_token}" in r and "int8" in r for r in rows)
    assert any("KV in use (MiB)" in r and f"{in_use / 2**20:.1f}" in r for r in rows)


def test_npu_binaries_row_against_tensor_bytes(quick_run: dict[str, Any]) -> None:
    """A run on the NPU shows its context binaries' size as copies of the GGUF's tensors."""
    from rich.console import Console

    from npuchat.app.bench_render import render
    from npuchat.engine.bench_report import BenchReport, from_plain

    data = json.loads(quick_run["json"].read_text())
    tensors = data["memory"]["tensor_bytes"]
    data["memory"]["context_binary_bytes"] = 3 * tensors + tensors // 10
    console = Console(width=200, record=True)
    console.print(render(from_plain(BenchReport, data)))
    row = next(line for line in console.export_text().splitlines() if "NPU context" in line)
    assert "3.10× the GGUF's tensor bytes" in row


def test_prefix_reuse_and_speculation_sections(quick_run: dict[str, Any]) -> None:
    report = quick_run["report"]
    pr = report["prefix_reuse"]
    assert pr["cold_prefill_tokens"] >= pr["system_tokens"] > 100
    # the second conversation and the new process both start from the stored system prefix
    assert pr["shared_reused_tokens"] >= pr["system_tokens"]
    assert pr["restart_reused_tokens"] >= pr["system_tokens"]
    assert pr["shared_vs_cold"] == pytest.approx(
        pr["shared_ttft_s"]["median"] / pr["cold_ttft_s"]["median"]
    )
    spec = report["speculation"]
    assert spec["available"] and spec["modes"] == ["target", "lookup", "draft", "both"]
    assert report["model"]["draft"] == report["chat"]["draft"] == "lookup+syn-draft"
    assert [row["prompt"] for row in spec["prompts"]] == list(bench_suites.PROMPTS)
    for row in spec["prompts"]:
        target = row["modes"]["target"]
        assert target["drafted"] == 0
        assert target["exact"]  # plain greedy decoding repeats itself
        for mode in spec["modes"]:
            r = row["modes"][mode]
            assert r["exact"] == (r["first_difference"] is None)
            assert 0 <= r["accepted"] <= r["drafted"]
            if mode != "target":
                assert r["vs_target"] == pytest.approx(
                    r["decode_tps"]["median"] / target["decode_tps"]["median"]
                )


def test_llama_bench_runs_on_the_same_file_and_threads(quick_run: dict[str, Any]) -> None:
    calls = quick_run["calls"]
    assert calls, "llama-bench was not run"
    for args in calls:
        assert args[args.index("-m") + 1] == str(quick_run["gguf"].resolve())
        assert args[args.index("-t") + 1] == "1"
        assert args[args.index("-o") + 1] == "json"
    report = quick_run["report"]
    # the fake reports 1000 + n tok/s for pp n, and 50 + depth/100 for tg at depth d
    for row in report["prefill"]:
        assert row["llama_tps"] == 1000.0 + row["tokens"]
        assert row["ratio"] == pytest.approx(row["tps"]["median"] / (1000.0 + row["tokens"]))
    for row in report["decode"]:
        depth = 0 if row["context"] <= 128 else row["context"]
        assert row["ratio"] == pytest.approx(row["tps"]["median"] / (50.0 + depth / 100))


def test_table_shows_ratio_columns_and_chart(quick_run: dict[str, Any]) -> None:
    out = quick_run["stdout"]
    report = quick_run["report"]
    assert out.count("× llama.cpp") == 2  # prefill and decode tables
    for row in report["prefill"] + report["decode"]:
        assert f"{row['ratio']:.2f}×" in out
    assert "tok/s against context length" in out
    assert "TTFT after restart" in out and "Speculation" in out


def test_readme_section_from_the_report(
    quick_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_command.main(["--readme", str(quick_run["json"])]) == 0
    md = capsys.readouterr().out
    report = quick_run["report"]
    assert md.startswith("## Performance")
    assert report["machine"]["cpu"] in md and report["date"][:10] in md
    assert " ".join(report["machine"]["cpu_flags"]) in md  # AVX2 or AVX-512: which kernels ran
    row = next(line for line in md.splitlines() if line.startswith("| syn |"))
    pp512 = next(r for r in report["prefill"] if r["tokens"] == 512)
    assert f"{pp512['tps']['median']:.1f} ({pp512['ratio']:.2f}× llama.cpp)" in row


def test_readme_refuses_a_report_it_cannot_read(
    quick_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = json.loads(quick_run["json"].read_text())
    old["schema"] = 1
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "broken.json").write_text('{"schema": 2, "suite": "quick"}')
    for name, needle in (("old.json", "rerun `npuchat bench --json`"), ("broken.json", "not a")):
        assert bench_command.main(["--readme", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_ctrl_c_prints_what_was_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = write_synthetic_gguf(tmp_path / "syn.gguf", "llama", seed=5, context_length=1024)
    assert main(["import", str(gguf), "--name", "syn"]) == 0
    # skip the start-up processes (covered above); interrupt during the decode figures
    monkeypatch.setattr(bench.BenchRun, "measure_start", lambda self: None)

    def interrupted(*args: object, **kw: object) -> list[float]:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "time_decode", interrupted)
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    out = tmp_path / "partial.json"
    assert main(["bench", "--model", "syn", "--json", str(out)]) == 130
    report = json.loads(out.read_text())
    assert report["interrupted"] is True
    assert [r["tokens"] for r in report["prefill"]] == [128, 512]
    assert report["decode"] == [] and report["chat"] is None
    printed = capsys.readouterr().out
    assert "interrupted" in printed and "Prefill" in printed


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--llama-bench", "/no/such/llama-bench"], "no such executable"),
        (["--model", "missing"], "unknown model 'missing'"),
        (["--draft", "a+b"], "--draft a+b"),
        (["--threads", "-1"], "--threads must be at least 1"),
        (["--json", "/no/such/folder/r.json"], "its folder does not exist"),
    ],
)
def test_bench_errors(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "syn", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
