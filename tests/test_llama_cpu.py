"""`llama_bench.llama_cpu_ms`: llama.cpp's CPU time per token, its load subtracted, from a fake
llama-bench that spends a known CPU time per token (and a fixed one on loading)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from npuchat.engine.errors import NpuchatError
from npuchat.engine.llama_bench import llama_cpu_ms

# Spends 60 ms of CPU "loading", then 2 ms per token per repetition: prompt + generated tokens.
FAKE = """#!{python}
import sys, time
a = sys.argv
def spin(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
if "-p" not in a:
    sys.exit("no -p")
spin(0.06)
tokens = int(a[a.index("-p") + 1]) + int(a[a.index("-n") + 1])
spin(0.002 * tokens * int(a[a.index("-r") + 1]))
print("[]")
"""


def test_cpu_per_token_with_the_load_subtracted(tmp_path: Path) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    got = llama_cpu_ms(fake, tmp_path / "m.gguf", 1, 64, 32, 2)
    # the load run decodes one token (2 ms) that the decode test does not: within the bounds
    assert got["pp64_cpu_ms"] == pytest.approx(2.0, rel=0.25)
    assert got["tg32_cpu_ms"] == pytest.approx(2.0, rel=0.25)


def test_a_failing_binary_is_a_reason(tmp_path: Path) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('unknown argument: --no-warmup')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(NpuchatError, match="unknown argument"):
        llama_cpu_ms(fake, tmp_path / "m.gguf", 1, 64, 32, 2)
