"""ONNX Runtime sessions per device, and the compile-once cache of built graphs.

Building a model's graphs (decoding every GGUF block into `MatMulNBits` layout) takes seconds to
minutes; a chat app must not pay that on every start. Built files live under
`<cache_dir>/graphs/<key>/` with a manifest of their sizes and sha256 digests, written last and
atomically: a folder whose manifest is missing, or whose files no longer match it (a crash
mid-write, a truncated copy, bit rot), is rebuilt, never loaded. The key covers everything that
changes the bytes: the model's sha256, the graph specs, the builder version, the onnxruntime
version and the device options.

CPU sessions are made here (`create_session`); the NPU's are compiled and loaded by
`npu_compile`, since the QNN plugin EP is selected by device rather than by provider name. Which
device runs a model is decided in `devices`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import onnxruntime as ort  # type: ignore[import-untyped]

from . import hashing
from .devices import DEVICES, QNN_EP
from .errors import NpuchatError
from .gguf_initializers import gguf_initializers
from .graph_key import BUILDER_VERSION
from .hashing import sha256_file

T = TypeVar("T")
MANIFEST = "manifest.json"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # another user's process: leave its folder alone
    return True


def model_sha256(path: Path, cache_dir: Path) -> str:
    """`hashing.model_sha256`: the model's digest, hashed only when the file changed."""
    return hashing.model_sha256(path, cache_dir, sha256_file)


def cache_key(
    model_sha: str,
    spec_digest: str,
    builder_version: str,
    device: str,
    device_options: Mapping[str, Any],
) -> str:
    blob = json.dumps(
        {
            "model": model_sha,
            "specs": spec_digest,
            "builder": builder_version,
            "onnxruntime": ort.__version__,
            "device": device,
            "options": dict(device_options),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class GraphCache:
    """Built graph folders under `<cache_dir>/graphs/`, verified against their manifest."""

    def __init__(self, cache_dir: Path) -> None:
        self.root = Path(cache_dir) / "graphs"
        self.builds = 0  # how many folders this instance built (tests assert on it)
        self.pruned: list[str] = []  # folders of older builds this instance removed

    def folder(self, key: str) -> Path:
        return self.root / key

    def verify(self, key: str) -> bool:
        """True if the folder's manifest exists and every file matches its size and sha256.

        A file's digest is remembered beside the cache keyed by its path, inode, size, mtime and
        ctime (`hashing.model_sha256`, the model file's own rule): any write to it since moves
        its ctime and it is hashed again, and an unchanged file costs a stat, not a read (the
        1.5B model's graph folder holds ~950 MB of regrouped weights: ~0.6 s of hashing)."""
        folder = self.folder(key)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            files = manifest["files"]
            for name, rec in files.items():
                path = folder / name
                if path.stat().st_size != rec["size"]:
                    return False
                if model_sha256(path, self.root.parent) != rec["sha256"]:
                    return False
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return bool(files)

    def get_or_build(
        self, key: str, build: Callable[[Path], None], meta: Mapping[str, Any] | None = None
    ) -> Path:
        """The verified folder for `key`, building it first if it is absent or damaged."""
        folder = self.folder(key)
        if self.verify(key):
            return folder
        self._remove_stale_builds()
        tmp = self.root / f"{key}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir(parents=True)
        try:
            build(tmp)
            digests = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            files = {
                name: {"size": (tmp / name).stat().st_size, "sha256": digest}
                for name, digest in digests.items()
            }
            stamp = {"builder": BUILDER_VERSION, "onnxruntime": ort.__version__}
            full_meta: dict[str, Any] = {**(meta or {}), **stamp}
            manifest = {"key": key, "files": files, "meta": full_meta}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
            for name, digest in digests.items():  # hashed just now: the next verify is a stat
                hashing.remember_sha256(folder / name, self.root.parent, digest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.builds += 1
        self._prune_superseded(key, full_meta)
        return folder

    def load(
        self,
        key: str,
        build: Callable[[Path], None],
        open_folder: Callable[[Path], T],
        meta: Mapping[str, Any] | None = None,
    ) -> tuple[Path, T]:
        """`open_folder` on the verified folder for `key`, verifying while it opens.

        Hashing a 1.3 GB folder takes ~1.3 s (a file unchanged since it was last hashed costs a
        stat: `verify`) and ONNX Runtime's session start (weight prepacking, without the native
        kernels) ~3.3 s; both release the GIL, so they run side by side.
        The opened result is handed out only after every file matched its manifest: a folder
        that fails is rebuilt and opened again, and the first result (which may have read
        damaged bytes) is dropped unused. A folder with no manifest or a wrong file size is
        rebuilt up front.
        """
        folder = self.folder(key)
        if not self._sizes_match(folder):
            folder = self.get_or_build(key, build, meta)
            return folder, open_folder(folder)
        verdict: list[bool] = []
        checker = threading.Thread(target=lambda: verdict.append(self.verify(key)), daemon=True)
        checker.start()
        try:
            opened: T | None = open_folder(folder)
            failure: BaseException | None = None
        except Exception as exc:  # damaged files can fail to open: the verdict decides
            opened, failure = None, exc
        checker.join()
        if verdict and verdict[0]:
            if failure is not None:
                raise failure
            return folder, opened  # type: ignore[return-value]
        opened = failure = None  # never used: it may have read damaged bytes (and the failure
        # would hold its frames, views of the model file among them, until a collection)
        folder = self.get_or_build(key, build, meta)
        return folder, open_folder(folder)

    def _remove_stale_builds(self) -> None:
        """Remove half-built folders (`<key>.tmp-PID-N`) whose building process is gone: a
        build killed with kill -9 cannot clean up after itself, and each is tens of MB."""
        if not self.root.is_dir():
            return
        for folder in self.root.glob("*.tmp-*-*"):
            pid_text = folder.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
            if pid_text.isdigit() and folder.is_dir() and not _process_alive(int(pid_text)):
                shutil.rmtree(folder, ignore_errors=True)

    def _sizes_match(self, folder: Path) -> bool:
        try:
            files = json.loads((folder / MANIFEST).read_text())["files"]
            return bool(files) and all(
                (folder / name).stat().st_size == rec["size"] for name, rec in files.items()
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    def _prune_superseded(self, key: str, meta: Mapping[str, Any]) -> None:
        """Remove this model's folders that an older builder or ONNX Runtime made.

        Their keys can never match again (both are part of the key), so after an upgrade they
        are only disk: gigabytes per model. Folders of other models, and this model's other
        graph sets (another device, capacity or precision), are left alone.
        """
        if "sha256" not in meta:
            return
        for folder in self.root.iterdir():
            if folder.name == key or not folder.is_dir() or ".tmp-" in folder.name:
                continue
            try:
                old = json.loads((folder / MANIFEST).read_text())["meta"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not a finished folder of ours: leave it
            if old.get("sha256") != meta["sha256"]:
                continue
            if (old.get("builder"), old.get("onnxruntime")) != (
                meta["builder"],
                meta["onnxruntime"],
            ):
                shutil.rmtree(folder, ignore_errors=True)
                self.pruned.append(folder.name)


def providers_for(device: str) -> list[str]:
    """The execution providers for a device name (an unknown name is an error here)."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "npu":  # a plugin EP: its sessions select its device (npu_compile)
        return [QNN_EP]
    raise NpuchatError(f"unknown device {device!r}; use one of: {', '.join(DEVICES)}")


def session_options_for(
    device: str, threads: int | None, kernels: Path | None = None
) -> ort.SessionOptions:
    """`kernels`: the native kernel library (`custom_ops`) the graph's QMatMul nodes need."""
    so = ort.SessionOptions()
    if kernels is not None:
        so.register_custom_ops_library(str(kernels))
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    # Not "session.prepack.enable_parallel": it starts the 1.5B model in 2.2 s instead of 3.3 s,
    # but maps every weight before packing any, and peak RSS rises from 2.0 to 2.9 GB.
    spin = os.environ.get("NPUCHAT_ORT_SPIN")
    if spin is not None:  # benchmarking knob: spinning threads vs a busy machine
        so.add_session_config_entry("session.intra_op.allow_spinning", spin)
    profile = os.environ.get("NPUCHAT_ORT_PROFILE")
    if profile:  # benchmarking knob: ONNX Runtime's per-op trace, PREFIX*.json per session
        so.enable_profiling, so.profile_file_prefix = True, profile
    return so


def create_session(
    onnx_path: Path,
    device: str,
    threads: int | None,
    kernels: Path | None = None,
    gguf: Path | None = None,
) -> ort.InferenceSession:
    """`gguf`: the model file, for graphs whose weights are read where they lie in it."""
    so = session_options_for(device, threads, kernels)
    shared = gguf_initializers(onnx_path, gguf) if gguf is not None else None
    if shared is not None:
        shared.add_to(so)
    try:
        session = ort.InferenceSession(str(onnx_path), so, providers=providers_for(device))
        return shared.attach(session) if shared is not None else session
    except Exception as exc:
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        raise NpuchatError(
            f"ONNX Runtime could not load {onnx_path.name} ({str(exc).splitlines()[0][:200]}); "
            "delete the cache folder and start again"
        ) from exc
