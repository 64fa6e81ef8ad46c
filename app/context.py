"""What every command needs: folders, settings, the raw config table and the model catalog."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from npuchat.engine.catalog import Catalog
from npuchat.engine.paths import Paths

from .settings import Settings, load_settings, read_toml


@dataclass
class AppContext:
    paths: Paths
    settings: Settings
    config: dict[str, Any]
    catalog: Catalog

    @classmethod
    def load(cls) -> AppContext:
        paths = Paths.from_env()
        config = read_toml(paths.config_file)
        return cls(
            paths=paths,
            settings=load_settings(paths.config_file),
            config=config,
            catalog=Catalog.load(paths, config.get("models")),
        )

    def with_settings(self, **given: Any) -> AppContext:
        """This context with the settings a command line gave (None: not given, the file's)."""
        changed = {name: value for name, value in given.items() if value is not None}
        return replace(self, settings=replace(self.settings, **changed)) if changed else self
