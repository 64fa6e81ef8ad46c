"""Builds the native kernel library (`engine/native/`) once per machine, reproducibly.

The library is an ONNX Runtime custom-op library: it includes ONNX Runtime's C/C++ API headers,
which the onnxruntime wheel does not ship. They come from a registry package at build time, never
from this repository: the npm package `com.github.asus4.onnxruntime` (a Unity build of ONNX
Runtime) carries them in its iOS framework's `Headers/` folder. Its tarball is pinned by sha256,
fetched with `npm pack` and only the headers are kept. Their API version (29) is older than
the runtime's (onnxruntime 1.32 serves API 32): the C API is ABI-stable, and a library asks the
runtime for the version it was built against.

The build is keyed by the sources, the header package and the compiler, and lands atomically in
`<kernel cache>/<key>/` beside its sha256: a second process reuses it after checking the digest
(a damaged library is refused with the reason, never loaded or deleted), a changed source builds
a new one. Any step
that cannot run here (no npm, no compiler, no network) raises `KernelBuildError` with the reason;
the engine then keeps its pure-ONNX-Runtime graphs (`custom_ops`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from .errors import NpuchatError
from .hashing import sha256_file
from .paths import Paths

__all__ = [
    "HEADER_API_VERSION",
    "HEADER_PACKAGE",
    "KernelBuildError",
    "build_kernels",
    "kernel_cache_dir",
]

HEADER_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
HEADER_TARBALL_SHA256 = "e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d"
HEADER_API_VERSION = 29  # ORT_API_VERSION in that package's onnxruntime_c_api.h
_HEADER_FOLDER = (
    "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers/"
)
SOURCE_DIR = Path(__file__).parent / "native"
SOURCES = (
    "qdot_scalar.cc",
    "qdot_avx2.cc",
    "qdot_vnni.cc",  # qdot_avx2.cc again, on AVX-VNNI
    "qdot_avx512.cc",  # and on AVX-512 VNNI
    "qmatmul_op.cc",
    "qmatmul_act.cc",
    "attention_op.cc",
    "attention_avx2.cc",
    "attention_few_avx2.cc",
    "rope_attention_op.cc",
    "regroup.cc",
    "kernels_entry.cc",
)
HEADERS = (
    "half.h",
    "qblocks.h",
    "qdot_x86.h",
    "q4k_x8_x86.h",
    "q6k_x8_x86.h",
    "blocks_x8_x86.h",
    "qmatmul_act.h",
    "attention.h",
    "attention_x86.h",
    "exp_x86.h",
)
LIBRARY_NAME = "libnpuchat_kernels.so"
CACHE_ENV = "NPUCHAT_KERNEL_CACHE"
_TIMEOUT_S = 600


class KernelBuildError(NpuchatError):
    """The kernel library cannot be built here; the message says why."""


def kernel_cache_dir() -> Path:
    """Where headers and built libraries live: `$NPUCHAT_KERNEL_CACHE`, else the cache folder."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Paths.from_env().cache_dir / "kernels"


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"{cmd[0]} failed: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise KernelBuildError(f"{' '.join(cmd[:2])} failed: {' / '.join(tail)[:400]}")


def ensure_headers(root: Path) -> Path:
    """The folder of ONNX Runtime API headers, fetched from the npm package on first use."""
    folder = root / f"ort-headers-{HEADER_PACKAGE.rsplit('@', 1)[1]}"
    if (folder / "onnxruntime_cxx_api.h").is_file():
        return folder
    npm = shutil.which("npm")
    if npm is None:
        raise KernelBuildError(
            f"npm is not installed (the ONNX Runtime headers: npm {HEADER_PACKAGE})"
        )
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        work = Path(tmp)
        _run([npm, "pack", "--silent", HEADER_PACKAGE], work)
        tarballs = list(work.glob("*.tgz"))
        if len(tarballs) != 1:
            raise KernelBuildError(f"npm pack {HEADER_PACKAGE} gave no tarball")
        digest = sha256_file(tarballs[0])
        if digest != HEADER_TARBALL_SHA256:
            raise KernelBuildError(f"npm {HEADER_PACKAGE}: unexpected tarball sha256 {digest}")
        staged = work / "headers"
        staged.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith(_HEADER_FOLDER):
                    name = member.name[len(_HEADER_FOLDER) :]
                    if "/" in name or not name.endswith(".h"):
                        continue
                    src = tar.extractfile(member)
                    assert src is not None
                    (staged / name).write_bytes(src.read())
        if not (staged / "onnxruntime_cxx_api.h").is_file():
            raise KernelBuildError(f"npm {HEADER_PACKAGE} holds no onnxruntime_cxx_api.h")
        try:
            staged.rename(folder)
        except OSError:  # another process got there first
            if not (folder / "onnxruntime_cxx_api.h").is_file():
                raise
    return folder


def _compiler() -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++) found")
    return cxx


def _build_key(cxx: str) -> str:
    h = hashlib.sha256(HEADER_PACKAGE.encode() + b"+digest")  # builds that record their sha256
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((SOURCE_DIR / name).read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    h.update(version.stdout.encode())
    return h.hexdigest()[:16]


def build_kernels(root: Path | None = None) -> Path:
    """The path of the built library (building it first if this machine has none yet)."""
    root = kernel_cache_dir() if root is None else root
    cxx = _compiler()
    target = root / _build_key(cxx) / LIBRARY_NAME
    digest = target.with_name(LIBRARY_NAME + ".sha256")
    try:
        if target.is_file():
            if not digest.is_file() or digest.read_text().strip() != sha256_file(target):
                raise KernelBuildError(
                    f"the kernel library {target} is damaged (sha256 differs from its build); "
                    f"delete {target.parent} to rebuild it"
                )
            return target
        headers = ensure_headers(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / LIBRARY_NAME
            # -ffp-contract=off: a row's float steps are the same in every kernel instance
            flags = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall"]
            flags.append("-ffp-contract=off")
            sources = [str(SOURCE_DIR / s) for s in SOURCES]
            _run([cxx, *flags, f"-I{headers}", *sources, "-o", str(out)], SOURCE_DIR)
            (Path(tmp) / digest.name).write_text(sha256_file(out) + "\n")
            os.replace(Path(tmp) / digest.name, digest)  # the digest first: never a bare library
            os.replace(out, target)
    except OSError as exc:  # an unwritable or vanished cache folder
        raise KernelBuildError(f"the kernel cache {root} cannot be used: {exc}") from exc
    return target
