"""A comparison's sources: run directories and variants of one, resolved from the command line's specs
(report.compare has the page and the module docstring on what a source is)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd
import yaml

from decodescope.core.phases import PHASE_OF
from decodescope.report.index import default_output_dir, read_manifest, run_dirs
from decodescope.schema.rundata import RunDir
from decodescope.schema.views import EntryView, ManifestView, key_path


VARIANTS = "variants"


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


_PLAIN_NAME = re.compile(r"^[^/\0]+$")


class CompareError(ValueError):
    """A source that cannot be compared: the message names the path and what would be valid."""

    def __init__(self, path: Path, message: str):
        self.path = Path(path)
        super().__init__(f"{path}: {message}")


# ---- sources ---------------------------------------------------------------------------------------
@dataclass
class Source:
    spec: str
    letter: str
    run_dir: Path
    variant: Optional[str]
    data_dir: Path
    manifest: ManifestView
    params: dict
    params_from: str

    @property
    def label(self) -> str:
        return self.run_dir.name + (f":{self.variant}" if self.variant else "")

    @property
    def name(self) -> str:
        """The source in legends: its letter and label."""
        return f"{self.letter}: {self.label}"

    def rel(self, name: str) -> str:
        """A data file's path as the page names it (inside the run directory)."""
        try:
            return str((self.data_dir / name).relative_to(self.run_dir))
        except ValueError:
            return str(self.data_dir / name)

    @property
    def variant_entry(self) -> Optional[EntryView]:
        """The run manifest's record of this variant (manifest.json `variants`), None for a run."""
        return self.manifest.variants.get(self.variant) if self.variant else None

    def phase_status(self, phase: str) -> str:
        """The phase's status in the manifest; for a variant, the variant's status for the phases a
        variant runs (01, and 04 when it asked for a profile), else 'not run for a variant'."""
        if self.variant is not None:
            entry = self.variant_entry or EntryView()
            runs = {"01_serving"} | ({"04_profile"} if (entry.params or {}).get("profile") else set())
            if phase not in runs:
                return "not run for a variant"
            return f"variant {_status_or(entry, 'not in the manifest')}"
        info = self.manifest.phases.get(phase)
        return _status_or(info, "pending") if info is not None else "not in the manifest"

    @property
    def status(self) -> str:
        if self.variant is not None:
            return _status_or(self.variant_entry or EntryView(), "not in the manifest")
        return "" if self.manifest.status is None else self.manifest.status

    @property
    def tensor_parallel(self) -> Optional[int]:
        tp = key_path(self.params, "server", "tensor_parallel")
        try:
            return int(tp) if tp is not None and int(tp) >= 1 else None
        except (TypeError, ValueError):
            return None

    def missing_note(self, name: str, problem: str) -> str:
        phase = PHASE_OF.get(name)
        status = f" ({phase}: {self.phase_status(phase)})" if phase else ""
        return f"{self.name} {problem}{status}."


def _status_or(entry: EntryView, unset: str) -> str:
    """An entry's status; `unset` where the manifest gives it none (as a key left out)."""
    return str(entry.status) if "status" in entry.model_fields_set else unset


def _read_yaml(path: Path) -> Optional[dict]:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return raw if isinstance(raw, dict) else None


def _split_spec(spec: str) -> tuple[Path, Optional[str]]:
    """(run directory, variant name or None) of `RUN_DIR`, `RUN_DIR/variants/NAME` or `RUN_DIR:NAME`."""
    p = Path(spec)
    if p.parent.name == VARIANTS and (p.parent.parent / "manifest.json").is_file():
        return p.parent.parent, p.name
    if not p.exists() and ":" in spec:
        base, _, name = spec.rpartition(":")
        if base and name:
            return Path(base), name
    return p, None


def resolve(spec: str, letter: str = "A") -> Source:
    """The source a command-line argument names; CompareError (naming the path) when it is not a run
    directory or a variant of one."""
    run_dir, variant = _split_spec(str(spec))
    if not run_dir.exists():
        raise CompareError(run_dir, "no such directory; give a run directory (outputs/<run>/), "
                                    "RUN_DIR/variants/NAME or RUN_DIR:NAME")
    if not run_dir.is_dir():
        raise CompareError(run_dir, "not a directory; give a run directory (outputs/<run>/)")
    manifest = read_manifest(run_dir)
    if manifest is None:
        raise CompareError(run_dir, "not a run directory: it has no manifest.json (run directories are made "
                                    "by `decodescope run`, under outputs/)")
    params_from = "params.yaml"
    params = _read_yaml(run_dir / "params.yaml")
    if params is None:
        params, params_from = manifest.params, "manifest.json"
    data_dir = RunDir(run_dir).data
    if variant is not None:
        vdir = run_dir / VARIANTS / variant
        if not _PLAIN_NAME.match(variant) or variant in (".", "..") or not vdir.is_dir():
            found = sorted(p.name for p in (run_dir / VARIANTS).glob("*") if p.is_dir()) \
                if (run_dir / VARIANTS).is_dir() else []
            raise CompareError(vdir, f"no such variant of this run; its variants: {found or 'none'}")
        data_dir = RunDir(vdir).data if RunDir(vdir).data.is_dir() else vdir
        own_params = _read_yaml(vdir / "params.yaml")
        if own_params is not None:
            params, params_from = own_params, f"{VARIANTS}/{variant}/params.yaml"
    return Source(spec=str(spec), letter=letter, run_dir=run_dir.resolve(), variant=variant,
                  data_dir=data_dir.resolve(), manifest=manifest, params=params, params_from=params_from)


def load_sources(specs: Sequence[str]) -> list[Source]:
    """The sources, lettered A, B, ... in the order given; at least two."""
    specs = [str(s) for s in specs]
    if len(specs) < 2:
        raise CompareError(Path(specs[0]) if specs else Path("."),
                           "compare needs at least two runs or variants, e.g. "
                           "`decodescope compare outputs/RUN_A outputs/RUN_B`")
    if len(specs) > len(LETTERS):
        raise CompareError(Path(specs[len(LETTERS)]), f"at most {len(LETTERS)} sources on one page")
    return [resolve(s, LETTERS[i]) for i, s in enumerate(specs)]


def default_runs(output_dir: Optional[Path] = None, n: int = 2) -> list[str]:
    """The n newest run directories (by name: they start with their UTC time) of an output folder
    (default: the repository's outputs/), oldest first: the notebook's default."""
    return [str(p) for p in run_dirs(Path(output_dir) if output_dir else default_output_dir())[-n:]]


def _read_table(src: Source, name: str) -> tuple[Optional[pd.DataFrame], Optional[str]]:
    path = src.data_dir / name
    if not path.is_file():
        return None, src.missing_note(name, f"has no {src.rel(name)}")
    try:
        return pd.read_parquet(path), None
    except Exception as e:  # cut short, not parquet: named, not fatal
        return None, src.missing_note(name, f"has an unreadable {src.rel(name)} ({type(e).__name__}: {e})")


