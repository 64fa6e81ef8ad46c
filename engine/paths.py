"""Where npuchat keeps its files.

All locations come from platformdirs, except that one environment variable, `NPUCHAT_HOME`,
moves all of them under one folder (tests, portable installs, a second profile).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "npuchat"
HOME_ENV = "NPUCHAT_HOME"


@dataclass(frozen=True)
class Paths:
    """The four folders npuchat uses. Created on demand by the code that writes into them."""

    config_dir: Path
    data_dir: Path
    cache_dir: Path
    models_dir: Path

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    @property
    def database_file(self) -> Path:
        return self.data_dir / "conversations.sqlite3"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Paths:
        """Resolve the folders from `NPUCHAT_HOME` if set, else from the platform conventions."""
        env = os.environ if environ is None else environ
        home = env.get(HOME_ENV)
        if home:
            root = Path(home).expanduser().resolve()
            return cls(
                config_dir=root / "config",
                data_dir=root / "data",
                cache_dir=root / "cache",
                models_dir=root / "models",
            )
        data = Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
        return cls(
            config_dir=Path(platformdirs.user_config_dir(APP_NAME, appauthor=False)),
            data_dir=data,
            cache_dir=Path(platformdirs.user_cache_dir(APP_NAME, appauthor=False)),
            models_dir=data / "models",
        )

    def as_dict(self) -> dict[str, str]:
        return {
            "config": str(self.config_dir),
            "data": str(self.data_dir),
            "cache": str(self.cache_dir),
            "models": str(self.models_dir),
        }
