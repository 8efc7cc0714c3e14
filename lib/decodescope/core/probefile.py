"""How a micro-benchmark probe writes its output file (data/gemm_raw.json, data/collectives_ranks/
collectives_rank<r>.json, data/step_ranks/step_rank<r>.json): the standard library only, as the probes run on
a GPU host whose image may have torch and nothing else of decodescope's dependencies (no pydantic, no pandas).
Its typed reader is decodescope.schema.records_probe.ProbeOutput, which reads the version and row keys from here.
"""
from __future__ import annotations

from pathlib import Path

from decodescope.core.io import write_json_atomic

PROBE_OUTPUT_VERSION = 1
# what every reader of a probe's row relies on, per probe; a row's other columns are the probe's own
ROW_KEYS: dict[str, tuple[str, ...]] = {
    "gemm": ("op", "dtype", "status"),
    "collectives": ("part", "op", "status"),
    "step": ("batch", "variant", "mode", "status"),
}


def write_probe_output(path, probe: str, rows: list[dict], meta: dict | None = None) -> Path:
    """The probe's rows so far, atomically: a crash leaves the previous part's file or this one. No
    validation here: a probe keeps measuring, and its reader says what is wrong with a row."""
    if probe not in ROW_KEYS:
        raise ValueError(f"probe {probe!r}: one of {', '.join(ROW_KEYS)}")
    return write_json_atomic(Path(path), {"schema_version": PROBE_OUTPUT_VERSION, "probe": probe,
                                          "meta": meta or {}, "rows": rows})
