"""manifest.json of a run as the runner keeps it: created or reopened, rewritten atomically at every
change, with a few bytes of the disk held back so that a full disk still lets the final status be written."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from pydantic import BaseModel

from decodescope.core import resources
from decodescope.exec.hardware import cpu_summary, package_versions
from decodescope.schema.params import Params, flatten_dotted, params_as_dict
from decodescope.core.io import write_text_atomic
from decodescope.schema.records import RecordError, read_record, write_record
from decodescope.schema.records_manifest import ManifestHost, ParamsChange, PhaseEntry, RunManifest, VariantEntry

# Kept free on the run's disk and released when a write fails, so the manifest can still say "failed".
MANIFEST_RESERVE_BYTES = 256 * 1024
# The repository checkout this runs from (None for an installed wheel): the manifest names its commit.
REPO_ROOT = resources.source_checkout()


class RunError(RuntimeError):
    pass


class ResultsWriteError(RunError):
    """A result file could not be written (disk full, read-only, quota): the run stops here."""

    def __init__(self, path: Path, err: OSError):
        self.path, self.errno = Path(path), err.errno
        super().__init__(f"could not write {path}: [Errno {err.errno}] {err.strerror or err}; "
                         "the results written before this point are kept")


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def git_commit(repo: Optional[Path] = REPO_ROOT) -> Optional[str]:
    if repo is None:  # an installed wheel: no commit to name
        return None
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class Manifest:
    """manifest.json of one run, held as its typed record (records_manifest.RunManifest) and rewritten atomically at
    every change. The runner sets the record's fields; the manifest's models check each value as it is
    set (validate_assignment), so a value of the wrong type fails where it is set, before any file."""

    def __init__(self, path: Path, record: RunManifest):
        self.path, self.record = path, record
        self._lock = threading.Lock()

    @classmethod
    def create(cls, run_dir: Path, params: Params, phases: list[str]) -> "Manifest":
        cpu = cpu_summary()
        record = RunManifest(
            run_id=run_dir.name,
            params_name=params.run_name,
            params_path=params.source_path,
            params=params_as_dict(params),
            git_commit=git_commit(),
            versions={**package_versions(), "python": sys.version.split()[0]},
            host=ManifestHost(kind=params.host.url, hostname=cpu.hostname, model=cpu.model,
                              logical_cores=cpu.logical_cores, memory_gib=cpu.memory_gib),
            created=utc_now(),
            status="running",
            phases={p: PhaseEntry(status="pending") for p in phases},
        )
        m = cls(run_dir / "manifest.json", record)
        m.save()
        return m

    @classmethod
    def load(cls, run_dir: Path) -> "Manifest":
        path = run_dir / "manifest.json"
        if not path.is_file():
            raise RunError(f"{run_dir} has no manifest.json; --resume needs a run directory made by "
                           "`decodescope run`")
        try:
            record = read_record(path, RunManifest)
        except RecordError as e:
            raise RunError(f"cannot resume: {e}") from None
        return cls(path, record)

    def record_params_change(self, params: dict, source_path: Optional[str]) -> None:
        """Record a params change on --resume, where the params differ from the run's.

        The params come as params_as_dict gives them.
        The earlier params.yaml is copied beside it (params.before-resume-N.yaml) and taken away.
        The runner writes the new one.
        The change is recorded, so what the phases after the resume ran with is on record.
        A resumed H200 run once showed 32 requests a level in its params.yaml.
        Its 01 had run the params file's 128."""
        changed = changed_params(self.record.params, params) if self.record.params else []
        if not changed:
            return
        run_params = self.path.with_name("params.yaml")
        before = run_params.with_name(f"params.before-resume-{len(self.record.resumed)}.yaml")
        try:
            if run_params.exists():
                write_text_atomic(before, run_params.read_text())
                run_params.unlink()
        except OSError as e:
            raise ResultsWriteError(before, e) from None
        self.record.params_changes = [*self.record.params_changes, ParamsChange(
            resumed=self.record.resumed[-1] if self.record.resumed else utc_now(), changed=changed, before=before.name)]
        self.record.params, self.record.params_path = params, source_path

    def save(self) -> None:
        with self._lock:
            try:
                write_record(self.path, self.record)
            except OSError as e:
                raise ResultsWriteError(self.path, e) from None

    @property
    def reserve_path(self) -> Path:
        return self.path.parent / ".manifest-reserve"

    def reserve_space(self) -> None:
        """Hold some bytes of the run's disk, so a full disk still lets the final manifest be written."""
        try:
            with open(self.reserve_path, "wb") as f:
                f.write(b"\0" * MANIFEST_RESERVE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            self.reserve_path.unlink(missing_ok=True)

    def try_save(self) -> Optional[ResultsWriteError]:
        """Save if the disk still allows it (using the reserved space if need be); the error otherwise
        (the caller is already failing)."""
        try:
            self.save()
        except ResultsWriteError as e:
            self.reserve_path.unlink(missing_ok=True)
            try:
                self.save()
            except ResultsWriteError:
                return e
            return e
        return None

    def release_reserve(self) -> None:
        self.reserve_path.unlink(missing_ok=True)

    def phase(self, name: str) -> PhaseEntry:
        return self.record.phases.setdefault(name, PhaseEntry(status="pending"))

    def variant(self, name: str) -> VariantEntry:
        """The entry of variant `name` as the record holds it (a new one pending). The whole mapping is assigned
        when a name is added: assignment is what marks the field for the file, and validation copies the
        mapping, so an entry added to a mapping held elsewhere would never reach the record."""
        if name not in self.record.variants:
            self.record.variants = {**self.record.variants, name: VariantEntry(status="pending")}
        return self.record.variants[name]

    def update_phase(self, name: str, **fields) -> None:
        set_fields(self.phase(name), **fields)
        self.save()


def set_fields(entry: BaseModel, **fields) -> None:
    """Each field set on a part of the manifest, checked as it is set and written to the file from then on."""
    for name, value in fields.items():
        setattr(entry, name, value)


def changed_params(before: dict, after: dict) -> list[str]:
    """The dotted keys whose values differ between two params dicts, each as 'key: before -> after'."""
    b, a = flatten_dotted(before), flatten_dotted(after)
    return [f"{k}: {b.get(k, '(absent)')} -> {a.get(k, '(absent)')}"
            for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)]
