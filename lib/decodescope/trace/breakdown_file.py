"""breakdown.json (`decodescope analyze-trace --breakdown`): the record it is written and read through.

A dataclass, not a pydantic model: the breakdown path imports neither pydantic nor numpy (it starts in a
few tens of ms; tests/test_trace_stream.py holds it to that), so the check on read is its own: every
field present with its JSON type, else BreakdownFileError naming the file and the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from decodescope.core.io import write_json_atomic
from decodescope.trace.breakdown import StreamedBreakdown

SCHEMA_VERSION = 1


class BreakdownFileError(ValueError):
    pass


@dataclass
class BreakdownFile:
    device: str
    ranks: list[int]
    # per rank and category: rank, category, time_us, calls, share, mean_us
    categories: list[dict]
    # rank (as a string: a JSON key) -> name -> time_us, dur_us, calls, rows
    names: dict[str, dict[str, dict]]
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    chunks_by_reader: dict[str, int] = field(default_factory=dict)
    json_bytes: int = 0
    events_seen: int = 0
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def of(cls, bd: StreamedBreakdown) -> "BreakdownFile":
        return cls(device=bd.device, ranks=list(bd.ranks), categories=bd.categories,
                   names={str(r): per for r, per in bd.names.items()}, warnings=bd.warnings, skipped=bd.skipped,
                   chunks_by_reader=bd.chunks_by_reader, json_bytes=sum(m.bytes_json for m in bd.metas),
                   events_seen=sum(m.events_seen for m in bd.metas))

    def write(self, path: Path) -> Path:
        return write_json_atomic(Path(path), asdict(self))

    @classmethod
    def read(cls, path: "str | Path") -> "BreakdownFile":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise BreakdownFileError(f"{path}: not a readable JSON file ({e})") from e
        if not isinstance(raw, dict):
            raise BreakdownFileError(f"{path}: a JSON object was expected, not {type(raw).__name__}")
        for name, kind in _FIELD_TYPES.items():
            if name not in raw:
                if name in _OPTIONAL:
                    continue
                raise BreakdownFileError(f"{path}: field '{name}' is missing (a breakdown.json of "
                                         "`decodescope analyze-trace --breakdown` has it)")
            if not isinstance(raw[name], kind) or isinstance(raw[name], bool):
                raise BreakdownFileError(f"{path}: field '{name}' is {type(raw[name]).__name__}, "
                                         f"expected {kind.__name__}")
        if raw.get("schema_version", SCHEMA_VERSION) > SCHEMA_VERSION:
            raise BreakdownFileError(f"{path}: schema_version {raw['schema_version']} is newer than this "
                                     f"decodescope reads ({SCHEMA_VERSION}): upgrade decodescope")
        return cls(**{k: raw[k] for k in _FIELD_TYPES if k in raw})


_FIELD_TYPES = {"device": str, "ranks": list, "categories": list, "names": dict, "warnings": list, "skipped": list,
                "chunks_by_reader": dict, "json_bytes": int, "events_seen": int, "schema_version": int}
# written before the record had them: read as their defaults
_OPTIONAL = {"schema_version"}
