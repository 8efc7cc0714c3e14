"""Typed records of what the micro-benchmark probes measured: data/gemm_raw.json (probes.gemm, 02),
data/collectives_ranks/collectives_rank<r>.json (probes.collectives, 03) and data/step_ranks/step_rank<r>.json
(probes.step, 03). A probe rewrites its file after each part it finishes (atomically), so a probe that dies
leaves the rows it had; 02 and 03 read them back through `read_probe_output`, which names the file and the
row at fault.

A row keeps the probe's own columns: each probe grows columns as it learns to measure more (a timing, a
communicator, a host reference), and the tables built from them (gemm.parquet, collectives.parquet,
step_replay.parquet) are where those columns are read. What every reader of a row relies on is declared
in decodescope.core.probefile (ROW_KEYS), with the writer the probes use: it needs the standard library only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from decodescope.core.io import read_json
from decodescope.core.probefile import PROBE_OUTPUT_VERSION, ROW_KEYS
from decodescope.schema.recordbase import Record, RecordError, validation_problems

ProbeName = Literal["gemm", "collectives", "step"]


class ProbeOutput(Record):
    """One probe's output file (for the torchrun probes, one rank's): the run's facts (`meta`: rank, world
    size, backend, communicators, versions) and one row per measurement, status ok or skipped with why."""

    schema_version: int = Field(PROBE_OUTPUT_VERSION, description="version of this record's layout; a reader "
                                "refuses any other")
    probe: ProbeName = Field(description="the probe that wrote it: gemm, collectives or step")
    meta: dict[str, Any] = Field(default_factory=dict, description="what the probe ran on (empty for gemm)")
    rows: list[dict[str, Any]] = Field(default_factory=list, description="one per measurement, in order")

    @model_validator(mode="after")
    def _rows_carry_their_keys(self) -> "ProbeOutput":
        need = ROW_KEYS[self.probe]
        for i, row in enumerate(self.rows):
            missing = [k for k in need if k not in row]
            if missing:
                raise ValueError(f"rows[{i}] lacks {', '.join(missing)} (every {self.probe} row has "
                                 f"{', '.join(need)})")
        return self


def read_probe_output(path, probe: str) -> ProbeOutput:
    """The probe output in `path`; RecordError naming the file for one that is not JSON, of another probe
    or version, or with a row that lacks a key its readers need. Files written before this record (gemm_raw
    a bare list of rows, the ranks' files an object of meta and rows) read as version 1 of `probe`."""
    path = Path(path)
    try:
        raw = read_json(path)
    except ValueError as e:
        raise RecordError(path, f"not JSON ({e}); expected a {probe} probe's output") from None
    if isinstance(raw, list):
        raw = {"rows": raw}
    if not isinstance(raw, dict):
        raise RecordError(path, f"a probe's output is a JSON object (or, before its record, a list of rows); "
                                f"found a {type(raw).__name__}")
    raw = {"schema_version": ProbeOutput.expected_version(), "probe": probe, **raw}
    if raw["probe"] != probe:
        raise RecordError(path, f"written by the {raw['probe']!r} probe, where the {probe} probe's output "
                                "was expected")
    try:
        return ProbeOutput.model_validate(raw)
    except ValidationError as e:
        raise RecordError(path, f"not a valid {probe} probe output: {validation_problems(e)}",
                          found=raw.get("schema_version"), expected=ProbeOutput.expected_version()) from None


def read_probe_rows(paths, probe: str) -> list[dict]:
    """Every row of the files in `paths` (a torchrun probe's ranks), in file order."""
    return [row for p in paths for row in read_probe_output(p, probe).rows]
