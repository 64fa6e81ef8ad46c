"""The model catalog: built-in entries (catalog.toml), user entries (config.toml), installed files.

A pulled model lives in the models folder as `NAME.gguf` beside `NAME.json`, a manifest written
after the file's sha256 was verified. An imported model stays where the user keeps it; its entry
in config.toml records its path, size and sha256. A model counts as installed when its file is
there with the recorded size and modification time; anything else is reported, never deleted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import IntegrityError, ModelNotFoundError, ModelNotInstalledError, NpuchatError
from .gguf_reader import GGUFFile
from .hashing import model_sha256
from .paths import Paths

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the member file inside it that holds (part of) the GGUF."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    arch: str
    params: str = ""
    quant: str = ""
    size: int = 0
    sha256: str | None = None
    description: str = ""
    default_draft: str | None = None
    parts: tuple[WheelPart, ...] = ()
    url: str | None = None
    path: Path | None = None  # imported models: where the user's file is
    builtin: bool = True
    kind: str = "chat"  # "base": a pretrained model without a chat template (completion use)

    @property
    def source(self) -> str:
        if self.path is not None:
            return "imported"
        if self.parts:
            return "pypi"
        return "url" if self.url else "none"


@dataclass(frozen=True)
class Manifest:
    """What was verified when a model file was installed."""

    name: str
    sha256: str
    size: int
    mtime_ns: int
    arch: str
    source: str

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.__dict__, indent=2))
        os.replace(tmp, path)


def _entry_from_table(
    name: str, t: Mapping[str, Any], *, builtin: bool, where: str
) -> CatalogEntry:
    try:
        parts = tuple(
            WheelPart(str(p["package"]), str(p["version"]), str(p["member"]))
            for p in t.get("parts", ())
        )
        path = t.get("path")
        return CatalogEntry(
            name=name,
            arch=str(t.get("arch", "")),
            params=str(t.get("params", "")),
            quant=str(t.get("quant", "")),
            size=int(t.get("size", 0)),
            sha256=t.get("sha256") or None,
            description=str(t.get("description", "")),
            default_draft=t.get("default_draft") or None,
            parts=parts,
            url=t.get("url") or None,
            path=Path(path).expanduser() if path else None,
            builtin=builtin,
            kind=str(t.get("kind", "chat")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise NpuchatError(f"{where}: model entry {name!r} is malformed ({exc})") from exc


def builtin_entries() -> dict[str, CatalogEntry]:
    import tomllib

    text = resources.files("npuchat.engine").joinpath("catalog.toml").read_text()
    table = tomllib.loads(text)["models"]
    return {
        n: _entry_from_table(n, t, builtin=True, where="built-in catalog") for n, t in table.items()
    }


@dataclass
class Catalog:
    """All known models: built-ins overlaid with the user's `[models.*]` tables."""

    paths: Paths
    entries: dict[str, CatalogEntry] = field(default_factory=dict)

    @classmethod
    def load(cls, paths: Paths, user_models: Mapping[str, Any] | None = None) -> Catalog:
        entries = builtin_entries()
        for name, table in (user_models or {}).items():
            if not isinstance(table, Mapping):
                raise NpuchatError(f"{paths.config_file}: [models.{name}] must be a table")
            entries[name] = _entry_from_table(
                name, table, builtin=False, where=str(paths.config_file)
            )
        return cls(paths, entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> CatalogEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise ModelNotFoundError(
                f"unknown model {name!r}; known models: {', '.join(self.entries)} "
                "(see `npuchat models`, or `npuchat import FILE.gguf --name NAME`)"
            ) from None

    def file_path(self, entry: CatalogEntry) -> Path:
        return (
            entry.path if entry.path is not None else self.paths.models_dir / f"{entry.name}.gguf"
        )

    def manifest_path(self, entry: CatalogEntry) -> Path:
        return self.paths.models_dir / f"{entry.name}.json"

    def installed(self, entry: CatalogEntry) -> Manifest | None:
        """The verified manifest if the model's file is present and unchanged since install."""
        path = self.file_path(entry)
        try:
            st = path.stat()
        except OSError:
            return None
        if entry.path is not None:  # imported: the entry itself records what was verified
            if entry.sha256 and st.st_size == entry.size:
                return Manifest(
                    entry.name, entry.sha256, st.st_size, st.st_mtime_ns, entry.arch, "imported"
                )
            return None
        manifest = Manifest.read(self.manifest_path(entry))
        if manifest is None or manifest.size != st.st_size or manifest.mtime_ns != st.st_mtime_ns:
            return None
        if entry.sha256 and manifest.sha256 != entry.sha256:
            return None
        return manifest

    def resolve(self, name: str) -> Path:
        """Path of an installed model, or a one-line error saying how to get it."""
        entry = self.get(name)
        manifest = self.installed(entry)
        if manifest is None:
            path = self.file_path(entry)
            if entry.path is not None:
                raise ModelNotInstalledError(
                    f"imported model {name!r}: {path} is missing or changed since import; "
                    f"run `npuchat import {path} --name {name}` again"
                )
            if path.exists():
                raise IntegrityError(
                    f"{path} does not match its verified manifest; "
                    f"run `npuchat pull {name} --force` to fetch it again"
                )
            raise ModelNotInstalledError(
                f"model {name!r} is not installed; run `npuchat pull {name}`"
            )
        path = self.file_path(entry)
        if entry.path is not None and entry.sha256:
            self._check_content(entry, path)
        elif entry.path is None:
            self._check_content(entry, path, manifest.sha256)
        return path

    def _check_content(self, entry: CatalogEntry, path: Path, pulled: str | None = None) -> None:
        """The file's bytes against the sha256 recorded at import (or at pull: `pulled`).
        Hashed once per change of the file's stamp (the digest is cached beside the graphs),
        so a file damaged or replaced in place is refused instead of producing garbage."""
        digest = model_sha256(path, self.paths.cache_dir)
        if pulled is not None and digest != pulled:
            raise IntegrityError(
                f"{path} changed since it was pulled (its sha256 no longer matches); run "
                f"`npuchat pull {entry.name} --force` to fetch it again"
            )
        if pulled is None and digest != entry.sha256:
            raise IntegrityError(
                f"{path} changed since it was imported (its sha256 no longer matches); if the"
                f" change is intended, run `npuchat import {path} --name {entry.name}` again"
            )


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise NpuchatError(
            f"invalid model name {name!r}: use lowercase letters, digits, '.', '-' and '_'"
        )
    return name


def describe_gguf(path: Path) -> dict[str, Any]:
    """Read what an import records: architecture, parameter count estimate, quant types."""
    with GGUFFile(path) as g:
        cfg = g.config  # raises UnsupportedModelError for other archs
        n_params = sum(t.n_elements for t in g.tensors.values())
        types = sorted({t.ggml_type.name for t in g.tensors.values() if len(t.shape) == 2})
    params = f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"
    return {"arch": cfg.arch, "params": params, "quant": "/".join(types)}
