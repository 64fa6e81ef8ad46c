"""Which CPU this is, as the kernels and the figures measured on it care: its model name, its
SIMD flags and its cores (two machines with the same core count can run different kernels)."""

from __future__ import annotations

import os
import platform

__all__ = ["SIMD_FLAGS", "cpu_model_and_flags", "machine_identity"]

# The instruction sets that decide which kernels run, ours and llama.cpp's (/proc/cpuinfo names).
SIMD_FLAGS = (
    "sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "asimd", "asimddp", "i8mm", "sve",
)  # fmt: skip


def cpu_model_and_flags(cpuinfo: str) -> tuple[str | None, list[str]]:
    """The first CPU's model name and its SIMD flags (in `SIMD_FLAGS` order) from /proc/cpuinfo
    text: two machines with the same core count can run different kernels (AVX2 or AVX-512)."""
    name: str | None = None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name is None:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, [f for f in SIMD_FLAGS if f in flags]


def machine_identity() -> str:
    """One line naming this machine's CPU: model, SIMD flags, cores, architecture (figures
    measured on one machine are not another's)."""
    try:
        with open("/proc/cpuinfo") as f:
            name, flags = cpu_model_and_flags(f.read())
    except OSError:
        name, flags = None, []
    cpu = name or platform.processor() or "unknown"
    return f"{cpu} [{' '.join(flags)}] cores={os.cpu_count()} {platform.machine()}"
