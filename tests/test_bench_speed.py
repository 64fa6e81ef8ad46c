"""`benchmarks/engine_speed.py` and its records (`engine/bench_speed.py`): figures as median
(min-max) over repeats, llama-bench's own repetitions beside them (a fake llama-bench that
prints a known tok/s per `-r` repetition), the CPU's SIMD flags, and a README table printed
again from the run's JSON file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic import write_synthetic_gguf

from npuchat.engine.bench_report import Figure, Machine
from npuchat.engine.bench_speed import (
    SpeedRow,
    SpeedRun,
    llama_summary,
    markdown_table,
    read_speed_run,
    summarize,
)
from npuchat.engine.cpu_info import cpu_model_and_flags
from npuchat.engine.errors import NpuchatError
from npuchat.engine.llama_bench import run_llama_bench

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "engine_speed.py"

# llama-bench `-o json` with one sample per `-r` repetition: pp n at 100 + n + i tok/s in
# repetition i, tg at 20 + i, so the median, min and max are known.
FAKE_LLAMA_BENCH = """\
#!{python}
import json, sys
a = sys.argv[1:]
opt = lambda name, default: a[a.index(name) + 1] if name in a else default
reps = int(opt("-r", "5"))
rows = []
for p in [int(x) for x in opt("-p", "512").split(",") if int(x)]:
    ts = [100.0 + p + i for i in range(reps)]
    rows.append({{"n_prompt": p, "n_gen": 0, "n_depth": 0, "avg_ts": sum(ts) / reps,
                 "stddev_ts": 1.0, "samples_ts": ts, "build_commit": "fake1"}})
if int(opt("-n", "128")):
    ts = [20.0 + i for i in range(reps)]
    rows.append({{"n_prompt": 0, "n_gen": int(opt("-n", "128")), "n_depth": 0,
                 "avg_ts": sum(ts) / reps, "stddev_ts": 1.0, "samples_ts": ts,
                 "build_commit": "fake1"}})
print(json.dumps(rows))
"""

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_1 sse4_2 avx f16c fma bmi2 avx2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_1 sse4_2 avx f16c fma bmi2 avx2 sha_ni
"""
XEON = "model name\t: Intel Xeon\nflags\t\t: avx2 avx512f avx512_vnni amx_tile fma avx\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\nCPU implementer\t: 0x41\n"


def _fake(tmp_path: Path) -> Path:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


def test_the_cpu_model_and_the_simd_flags_that_pick_the_kernels() -> None:
    assert cpu_model_and_flags(EPYC) == ("AMD EPYC 7B13", ["sse4_2", "avx", "f16c", "fma", "avx2"])
    name, flags = cpu_model_and_flags(XEON)
    assert name == "Intel Xeon" and {"avx512f", "avx512_vnni", "amx_tile"} <= set(flags)
    assert cpu_model_and_flags(ARM) == (None, ["asimd", "asimddp", "i8mm"])


def test_repeats_become_median_min_and_max() -> None:
    repeats = [
        {"prefill512_tps": 100.0, "kernels": "native", "built": True, "floor_ms": {"m1": 3.0}},
        {"prefill512_tps": 120.0, "kernels": "native", "built": True, "floor_ms": {"m1": 5.0}},
        {"prefill512_tps": 90.0, "kernels": "native", "built": True},
    ]
    got = summarize(repeats)
    assert got["prefill512_tps"] == Figure(100.0, 90.0, 120.0, 3)
    assert got["floor_ms.m1"] == Figure(4.0, 3.0, 5.0, 2)  # over the repeats that measured it
    assert set(got) == {"prefill512_tps", "floor_ms.m1"}  # strings and flags are not figures


def test_llama_bench_repetitions_are_its_samples(tmp_path: Path) -> None:
    bench = run_llama_bench(_fake(tmp_path), tmp_path / "m.gguf", 2, [512], 128, [], 3)
    got = llama_summary(bench, {"tg128_cpu_ms": 40.0})
    assert got["pp512"] == Figure(613.0, 612.0, 614.0, 3)
    assert got["tg128"] == Figure(21.0, 20.0, 22.0, 3)
    assert got["tg128_cpu_ms"] == Figure(40.0, 40.0, 40.0, 1)
    assert bench.build == "fake1"


def _row(**run: Figure) -> SpeedRow:
    one = Figure(1.0, 1.0, 1.0, 1)
    figures = {k: one for k in ("load_s", "peak_rss_mib", "rss_mib", "decode1024_tps")}
    return SpeedRow(
        model="m.gguf",
        gguf_bytes=100 * 2**20,
        kernels="npuchat GGUF-block kernels (avx2), /x/lib.so",
        mode="on",
        repeats=3,
        cold={"load_s": one, "peak_rss_mib": one},
        run=figures | run,
        kv_bytes=10 * 2**20,
        llama={"pp512": Figure(50.0, 45.0, 60.0, 3), "tg128": Figure(20.0, 19.0, 21.0, 3)},
    )


def test_the_readme_table_is_printed_again_from_the_written_run(tmp_path: Path) -> None:
    machine = Machine("AMD EPYC", 2, "Linux", "3.11", "1.32.0", "0.1", 0.5, ["avx2", "fma"])
    run = SpeedRun("2026-12-01 23:00 UTC", machine, 2, 3, "python benchmarks/engine_speed.py m")
    run.rows.append(
        _row(prefill512_tps=Figure(60.0, 55.0, 66.0, 3), decode128_tps=Figure(10.0, 9.0, 11.0, 3))
    )
    path = tmp_path / "run.json"
    run.write(path)
    table = markdown_table(read_speed_run(path))
    assert table == markdown_table(run)
    line = next(x for x in table.splitlines() if x.startswith("| m |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1] == "npuchat GGUF-block kernels (avx2)"
    assert cells[3] == "60.0 (55.0-66.0) (1.20×)"  # 60 / llama.cpp's median 50
    assert cells[4] == "10.0 (9.0-11.0) (0.50×)"
    assert cells[6] == "1 (140)"  # target 1.3 x 100 MiB + 10 MiB of KV
    assert cells[7] == "50.0 (45.0-60.0) / 20.0 (19.0-21.0)"
    assert "AMD EPYC (avx2, fma)" in table and "median (min-max) of 3" in table


def test_a_file_that_is_not_a_run_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"schema": 2, "suite": "quick"}))  # an `npuchat bench` report
    with pytest.raises(NpuchatError, match=r"not an engine_speed\.py --json run"):
        read_speed_run(bad)
    bad.write_text("{")
    with pytest.raises(NpuchatError, match="cannot read"):
        read_speed_run(bad)


def test_the_script_repeats_every_phase_and_sets_llama_cpp_beside_it(tmp_path: Path) -> None:
    gguf = write_synthetic_gguf(tmp_path / "syn.gguf", "llama", seed=3, context_length=2048)
    out = tmp_path / "run.json"
    cmd = [sys.executable, str(SCRIPT), str(gguf), "--threads", "1", "--repeats", "2"]
    cmd += ["--llama-bench", str(_fake(tmp_path)), "--json", str(out)]
    env = dict(os.environ, NPUCHAT_HOME=str(tmp_path / "home"))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = read_speed_run(out).rows
    assert row.repeats == 2
    for key in ("prefill512_tps", "decode128_tps", "decode1024_tps", "load_s", "peak_rss_mib"):
        f = row.run[key]
        assert f.n == 2 and 0 < f.min <= f.median <= f.max, key
    assert row.cold["load_s"].n == 2
    # llama-bench ran once per repeat (-r 1, beside each of ours): two samples of its first
    assert row.llama["pp512"] == Figure(612.0, 612.0, 612.0, 2)
    expected = row.run["prefill512_tps"].median / 612.0
    assert f"({expected:.2f}×)" in res.stdout
    table = subprocess.run(
        [sys.executable, str(SCRIPT), "--table", str(out)], capture_output=True, text=True
    )
    assert table.returncode == 0 and table.stdout in res.stdout
