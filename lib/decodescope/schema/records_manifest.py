"""manifest.json: the run's record (params, versions, host, each phase's and variant's status, the servers
started and torn down), which the runner sets field by field as the run goes, each value checked as it is
set. decodescope.schema.records says how records are versioned, read and written."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, Field

from decodescope.schema.recordbase import Record, _OpenModel


# ---- run manifest (manifest.json) ------------------------------------------------------------------
class _ManifestPart(_OpenModel):
    """A part of manifest.json, which the runner sets field by field: each value is checked as it is set."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=True)


class PhaseEntry(_ManifestPart):
    status: str = Field("pending", description="pending, running, ok, failed or skipped")
    start: Optional[str] = None
    end: Optional[str] = None
    error: Optional[str] = None
    duration_s: Optional[float] = None
    notebook: Optional[str] = Field(None, description="the executed notebook, relative to the run directory")
    stray_processes_stopped: Optional[int] = None


class ManifestHost(_ManifestPart):
    kind: Optional[str] = Field(None, description="params `host`")
    model: Optional[str] = Field(None, description="CPU model")
    logical_cores: Optional[int] = None
    memory_gib: Optional[float] = None
    hostname: Optional[str] = None


class ServerState(_ManifestPart):
    status: Optional[str] = None
    error: Optional[str] = None
    base_url: Optional[str] = None
    start_s: Optional[float] = None
    pids: Optional[list[int]] = None
    profiler_dir: Optional[str] = None
    launch: Any = None
    stopped: Optional[str] = None


class ServerLaunch(_ManifestPart):
    started: Optional[str] = None
    start_s: Optional[float] = None
    pids: Optional[list[int]] = None
    pgid: Optional[int] = None
    run_token: Optional[str] = None
    shm_files: Optional[list[str]] = None


class Teardown(_ManifestPart):
    at: Optional[str] = None
    signalled: Optional[int] = None
    shm_removed: Optional[int] = None
    left: Any = None


class VariantEntry(_ManifestPart):
    """One variant of params.experiments as the runner measured it (variants/<name>/)."""

    status: str = Field("pending", description="pending, running, ok or failed")
    start: Optional[str] = None
    end: Optional[str] = None
    duration_s: Optional[float] = None
    error: Optional[str] = Field(None, description="why it failed: the server's log tail, or each phase's error")
    params: dict[str, Any] = Field(default_factory=dict, description="the variant as params.experiments gives it")
    stray_processes_stopped: Optional[int] = None


class ParamsChange(_ManifestPart):
    """A --resume with other params: when, the keys ('key: before -> after'), the earlier params.yaml kept as."""
    resumed: str
    changed: list[str]
    before: str


class RunManifest(Record):
    """manifest.json: the run's params (secrets redacted), versions, host and each phase's status.
    The runner sets fields as the run goes (each checked as it is set); the file holds exactly the fields
    set (none filled in)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    run_id: str
    params_name: str
    params_path: Optional[str] = None
    params: dict[str, Any] = Field(default_factory=dict)
    git_commit: Optional[str] = None
    versions: dict[str, Any] = Field(default_factory=dict)
    host: Optional[ManifestHost] = None
    created: str
    status: str = Field(description="running, ok, failed or interrupted")
    phases: dict[str, PhaseEntry] = Field(default_factory=dict)
    resumed: list[str] = Field(default_factory=list, description="when the run was resumed")
    params_changes: list[ParamsChange] = Field(default_factory=list, description="other params on a --resume")
    server: Optional[ServerState] = None
    servers: list[ServerLaunch] = Field(default_factory=list, description="every server this run started")
    teardowns: list[Teardown] = Field(default_factory=list)
    variants: dict[str, VariantEntry] = Field(default_factory=dict, description="params.experiments, measured")
    overrides: dict[str, Any] = Field(default_factory=dict, description="params keys the command line replaced "
                                      "(e.g. workload.repeats from --repeats); --resume applies them again")
    stray_processes_stopped: Optional[int] = None
    error: Optional[str] = None
    finished: Optional[str] = None
    report: Optional[str] = Field(None, description="report.html, relative to the run directory")

    def to_json_dict(self) -> dict:
        return {"schema_version": self.schema_version, **self.model_dump(by_alias=True, exclude_unset=True)}
