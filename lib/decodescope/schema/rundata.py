"""One typed reader of a run directory's files (DESIGN.md, "Run directory contract"). Each file a phase
writes is read here, through its record or as its table. Other modules name a file under data/ through
`RunDir.file`; none joins paths under data/ itself.

Reads return None where the file is absent (its phase did not run), and raise RecordError for a record
that cannot be read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, TypeVar, Union

import pandas as pd

from decodescope.core.rundir import DATA, VARIANTS
from decodescope.schema.recordbase import Record, read_record
from decodescope.schema.records import HostOps, ProfileCapture, ProfileCaptures, ProfileSummary
from decodescope.schema.records_critpath import (CRITICAL_PATH_RECORD, SKEW_CALIBRATION_RECORD, CriticalPathSummary,
                                                 SkewCalibration)
from decodescope.schema.records_host import HostInventory
from decodescope.schema.records_manifest import RunManifest
from decodescope.schema.records_server import LinkMeasure, ServerInfo

R = TypeVar("R", bound=Record)
Name = Union[str, Path]   # a file's name under data/, or its path below data/

MANIFEST = "manifest.json"                       # the runner's, in the run directory itself
HOST = "host.json"                               # 00_host
SERVING_LEVELS = "serving_levels.parquet"        # 01_serving: one row per level
SERVING_REQUESTS = "serving_requests.parquet"    # 01_serving: one row per request
GEMM = "gemm.parquet"                            # 02_gemm
COLLECTIVES = "collectives.parquet"              # 03_collectives
SKEW_CALIBRATION = SKEW_CALIBRATION_RECORD       # 03_collectives: the critical path against a known skew
PROFILE_CAPTURES = "profile_capture.json"        # 04_profile: the levels profiled and each one's capture
PROFILE_SUMMARY = "profile_summary.json"         # 04_profile: the first level's summary (and each level's)
PROFILE_LEVELS = "profile"                       # 04_profile: profile/c<N>/, one folder per profiled level
VERDICT = "verdict.json"                         # 05_verdict
SERVER_INFO = "server.json"                      # the runner: how a phase reaches the run's server
LINK = "link.json"                               # the runner: what an ssh tunnel adds to a round trip


def level_dir_name(concurrency: int) -> str:
    """A profiled level's folder name, under data/profile/ and under traces/: c<N>."""
    return f"c{concurrency}"


class RunDir:
    """A run directory (or a variant's, laid out the same), read file by file."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def data(self) -> Path:
        return self.path / DATA

    def file(self, name: Name) -> Path:
        """A phase's file under data/ (a name such as `HOST`, or a path below data/)."""
        return self.data / name

    def level_dir(self, concurrency: int) -> Path:
        """One profiled level's folder: data/profile/c<N>/."""
        return self.data / PROFILE_LEVELS / level_dir_name(concurrency)

    def level_file(self, concurrency: int, name: str) -> Path:
        """A file of one profiled level: data/profile/c<N>/<name>."""
        return self.level_dir(concurrency) / name

    def variant(self, name: str) -> "RunDir":
        return RunDir(self.path / VARIANTS / name)

    # ---- tables and records by name ----------------------------------------------------------------
    def table(self, name: Name) -> Optional[pd.DataFrame]:
        """A parquet table under data/; None when absent."""
        path = self.file(name)
        return pd.read_parquet(path) if path.is_file() else None

    def record(self, name: Name, model: type[R]) -> Optional[R]:
        """A record under data/; None when absent."""
        path = self.file(name)
        return read_record(path, model) if path.is_file() else None

    # ---- each phase's files -------------------------------------------------------------------------
    def manifest(self) -> Optional[RunManifest]:
        path = self.path / MANIFEST
        return read_record(path, RunManifest) if path.is_file() else None

    def host(self) -> Optional[HostInventory]:
        return self.record(HOST, HostInventory)

    def serving_levels(self) -> Optional[pd.DataFrame]:
        return self.table(SERVING_LEVELS)

    def serving_requests(self) -> Optional[pd.DataFrame]:
        return self.table(SERVING_REQUESTS)

    def gemm(self) -> Optional[pd.DataFrame]:
        return self.table(GEMM)

    def collectives(self) -> Optional[pd.DataFrame]:
        return self.table(COLLECTIVES)

    def profile_summary(self) -> Optional[ProfileSummary]:
        """04's summary of its first level (data/profile_summary.json)."""
        return self.record(PROFILE_SUMMARY, ProfileSummary)

    def profile_captures(self) -> Optional[ProfileCaptures]:
        """04's record of the levels it profiled, why, and each level's capture."""
        return self.record(PROFILE_CAPTURES, ProfileCaptures)

    def profiled_levels(self) -> list[int]:
        """The levels 04 profiled, in its order; [] when it did not run."""
        captures = self.profile_captures()
        return list(captures.levels) if captures is not None else []

    def level_captures(self) -> dict[int, ProfileCapture]:
        """Concurrency -> each profiled level's capture."""
        captures = self.profile_captures()
        return {c.concurrency: c for c in captures.captures} if captures is not None else {}

    def level_records(self, name: str, model: type[R]) -> dict[int, R]:
        """Concurrency -> a profiled level's record `name` (data/profile/c<N>/<name>), for the levels 04
        profiled and the files it wrote there."""
        out = {}
        for c in self.profiled_levels():
            path = self.level_file(c, name)
            if path.is_file():
                out[c] = read_record(path, model)
        return out

    def level_summaries(self) -> dict[int, ProfileSummary]:
        """Concurrency -> each profiled level's summary (profile_summary.json)."""
        return self.level_records(PROFILE_SUMMARY, ProfileSummary)

    def critical_paths(self) -> dict[int, CriticalPathSummary]:
        """Concurrency -> each profiled level's critical-path record (critical_path.json)."""
        return self.level_records(CRITICAL_PATH_RECORD, CriticalPathSummary)

    def server_info(self) -> Optional[ServerInfo]:
        return self.record(SERVER_INFO, ServerInfo)

    def link(self) -> Optional[LinkMeasure]:
        return self.record(LINK, LinkMeasure)

    def skew_calibration(self) -> Optional[SkewCalibration]:
        """03's check of the critical path's arrival skew against a known delay."""
        return self.record(SKEW_CALIBRATION, SkewCalibration)

    def host_ops(self, name: Name) -> Optional[HostOps]:
        """04's un-graphed step's host ops (name: trace.hostops.HOST_OPS_RECORD)."""
        return self.record(name, HostOps)
