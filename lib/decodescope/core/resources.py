"""Files that ship with the package: the phase notebooks, the params templates (params/*.yaml,
params/models/*.json) and the kernel category rules (params/kernel_categories.yaml).

They are found under the package's own directory, `decodescope/_data/`, the same way in every install:
- in the repository, `lib/decodescope/_data/notebooks` and `.../_data/params` are relative symlinks.
  They point to the repository's notebooks/ and params/.
  So the files stay where users of the repository look for them and edit them.
  An editable install, which puts lib/ on sys.path, sees the same symlinks.
- a wheel (pyproject.toml, [tool.setuptools.package-data]) holds copies of the files the symlinks point to.
Both are plain directories on disk: decodescope is never imported from a zip.
So the paths are real paths that papermill and yaml can open.
They are found from this module's own path.
importlib.resources would say the same, at ~7 ms of imports in every start-up of `analyze-trace`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# decodescope/ itself: this module sits in decodescope/core/
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def data_path(*parts: str) -> Path:
    """A shipped file or folder, e.g. data_path("params", "default.yaml")."""
    return PACKAGE_DIR.joinpath("_data", *parts).resolve()


def notebook_dir() -> Path:
    return data_path("notebooks")


def params_dir() -> Path:
    return data_path("params")


def source_checkout() -> Optional[Path]:
    """The repository this package runs from (an editable install or lib/ on the path), for its git
    commit; None for an installed wheel, whose site-packages may sit inside some unrelated repository."""
    root = PACKAGE_DIR.parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "lib" / "decodescope").is_dir() else None


def cache_dir() -> Path:
    """The user's cache for what decodescope derives from its own files (the C scanner built, the rules
    parsed), each under a name holding a hash of its source: $XDG_CACHE_HOME/decodescope or ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decodescope"
