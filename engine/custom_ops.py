"""The native matmul kernels as an ONNX Runtime custom-op library, and whether to use them.

`npuchat.QMatMul` multiplies float activations by a weight matrix kept as the GGUF's own blocks
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K: llama.cpp's byte budget; all but Q4_0 with their rows
regrouped eight at a time, `graph_native.regroup_rows`), quantizing each activation row to int8
blocks as llama.cpp does; AVX2+FMA kernels where the CPU has them, portable ones elsewhere. Each
output is computed by the same steps whatever the number of rows, so a row never depends on the
rows beside it. The op also adds a bias and, on a SwiGLU MLP's fused gate|up rows, gives
silu(gate) * up (`glu`): ops a small model's step would otherwise dispatch.

The library is built on first use (`kernel_build`); a machine that cannot build it (no compiler,
no npm) keeps the pure-ONNX-Runtime path. `NPUCHAT_KERNELS` chooses: `auto` (use them when they
build; the default), `off`, or `on` (fail with the reason when they cannot be had). Against
`MatMulNBits` they start faster (nothing to prepack), hold less memory (llama.cpp's bytes per
weight) and cost less CPU per decode step; prefill costs more on small models
(`benchmarks/engine_speed.py --kernels on,off`).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort  # type: ignore[import-untyped]
from gguf import GGMLQuantizationType

from .errors import NpuchatError
from .kernel_build import HEADER_API_VERSION, KernelBuildError, build_kernels

__all__ = [
    "COVERED_TYPES",
    "DOMAIN",
    "MODE_ENV",
    "KernelLibrary",
    "kernel_library",
    "kernel_mode",
    "kernels_for",
    "native_regroup",
    "register_kernels",
]

DOMAIN = "npuchat"
MODE_ENV = "NPUCHAT_KERNELS"
MODES = ("auto", "off", "on")
DEFAULT_MODE = "auto"
Q = GGMLQuantizationType
COVERED_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K})


@dataclass(frozen=True)
class KernelLibrary:
    """The built library (`path`, with the instruction set it runs) or why there is none."""

    path: Path | None
    isa: str = ""
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.path is not None

    def describe(self) -> str:
        if self.path is None:
            return f"ONNX Runtime's MatMulNBits ({self.reason})"
        return f"npuchat GGUF-block kernels ({self.isa}), {self.path}"


def kernel_mode() -> str:
    mode = os.environ.get(MODE_ENV, DEFAULT_MODE).strip().lower() or DEFAULT_MODE
    if mode not in MODES:
        raise NpuchatError(f"{MODE_ENV}={mode!r} is not one of: {', '.join(MODES)}")
    return mode


def _runtime_api_version() -> int:
    major, minor = (int(p) for p in ort.__version__.split(".")[:2])
    return minor if major == 1 else 0


@functools.cache
def _cdll(path: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


@functools.cache
def _load(root: Path | None) -> KernelLibrary:
    if _runtime_api_version() < HEADER_API_VERSION:
        return KernelLibrary(None, reason=f"onnxruntime {ort.__version__} is older than 1.29")
    try:
        path = build_kernels(root)
    except KernelBuildError as exc:
        return KernelLibrary(None, reason=str(exc))
    try:
        lib = _cdll(path)
        lib.npuchat_kernel_isa.restype = ctypes.c_char_p
        isa = lib.npuchat_kernel_isa().decode()
    except (OSError, AttributeError) as exc:  # digest intact but not loadable here
        return KernelLibrary(None, reason=f"the kernel library {path} cannot be loaded: {exc}")
    return KernelLibrary(path, isa=isa)


def kernel_library(root: Path | None = None) -> KernelLibrary:
    """The kernel library for this process, built on first use; `off` mode gives none."""
    mode = kernel_mode()
    if mode == "off":
        return KernelLibrary(None, reason=f"{MODE_ENV}=off; auto or on uses the native kernels")
    lib = _load(root)
    if mode == "on" and not lib.available:
        raise NpuchatError(f"{MODE_ENV}=on but the kernels cannot be built: {lib.reason}")
    return lib


def kernels_for(accuracy_level: int) -> KernelLibrary:
    """The kernels a CPU graph of this `MatMulNBits` accuracy level uses: the native ones
    quantize activations to int8, as level 4 does; level 0 (float activations) keeps ORT's."""
    if accuracy_level != 4:
        return KernelLibrary(None, reason=f"accuracy level {accuracy_level}")
    return kernel_library()


RegroupFn = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p
)


def native_regroup() -> Callable[[int, int, int, int, int], int]:
    """The library's `npuchat_regroup(type, src, n, row_bytes, dst)` (`native/regroup.cc`):
    the eight-row layouts the graph build writes for the kernels that read them."""
    lib = kernel_library()
    if lib.path is None:
        raise NpuchatError(f"no kernel library: {lib.reason}")
    return RegroupFn(("npuchat_regroup", _cdll(lib.path)))


def register_kernels(so: ort.SessionOptions, lib: KernelLibrary) -> None:
    """Make the `npuchat` op domain known to sessions created with `so`."""
    if lib.path is None:
        raise NpuchatError(f"no kernel library: {lib.reason}")
    so.register_custom_ops_library(str(lib.path))
