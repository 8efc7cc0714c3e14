"""The records' base: a versioned pydantic model per file, its writer and its reader (decodescope.schema.records has
every record and re-exports these)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from decodescope.core.io import write_json_atomic


class RecordError(ValueError):
    """A record file that this version of decodescope cannot read: another schema_version, not JSON,
    or fields missing or of the wrong type. The message names the file."""

    def __init__(self, path: Path, message: str, found: Any = None, expected: Optional[int] = None):
        self.path, self.found, self.expected = Path(path), found, expected
        super().__init__(f"{path}: {message}")


class _Model(BaseModel):
    """Fields are exactly the declared ones: a misspelt or unexpected key is an error."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _OpenModel(BaseModel):
    """A part that code outside this module adds keys to (the runner's manifest): extra keys are kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Record(_Model):
    """A versioned record. Subclasses set the version by redefining `schema_version`'s default."""

    schema_version: int = Field(1, description="version of this record's layout; a reader refuses any other")

    @classmethod
    def expected_version(cls) -> int:
        return cls.model_fields["schema_version"].default

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != cls.expected_version():
            raise ValueError(f"schema_version {v} found, {cls.__name__} schema_version "
                             f"{cls.expected_version()} expected")
        return v

    def to_json_dict(self) -> dict:
        """What goes into the file (aliases as keys, NaN kept as JSON's NaN like every other result)."""
        return self.model_dump(by_alias=True)


R = TypeVar("R", bound=Record)


def columns_of(model: type[BaseModel]) -> list[str]:
    """A table's columns, in order, from the model of one of its rows."""
    return [f.alias or name for name, f in model.model_fields.items()]


def frame(rows: Sequence[BaseModel], model: type[BaseModel]):  # Sequence (covariant): any row model's list
    """Rows of a record as a DataFrame with the model's columns (also when there are no rows)."""
    return pd.DataFrame([r.model_dump(by_alias=True) for r in rows], columns=columns_of(model))


def write_record(path: Path, record: Record) -> Path:
    """The record as JSON, atomically: a crash leaves the old file or the new one."""
    return write_json_atomic(Path(path), record.to_json_dict())


def validation_problems(e: ValidationError) -> str:
    """Each field at fault and what is wrong with it, on one line."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(record)'}: {err['msg']}" for err in e.errors())


def read_record(path: Path, model: type[R]) -> R:
    """The record in `path`; RecordError (naming the file) for another schema_version or invalid fields."""
    path = Path(path)
    expected = model.expected_version()
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecordError(path, f"not JSON ({e}); expected a {model.__name__} record "
                                f"(schema_version {expected})", expected=expected) from None
    if not isinstance(raw, dict):
        raise RecordError(path, f"a {model.__name__} record is a JSON object, found a {type(raw).__name__}; "
                                f"written by an older decodescope? this one reads schema_version {expected}",
                          expected=expected)
    found = raw.get("schema_version")
    if type(found) is not int or found != expected:
        what = "no schema_version" if found is None else f"schema_version {found!r}"
        raise RecordError(path, f"{what} found, but this decodescope reads {model.__name__} schema_version "
                                f"{expected}; re-run the phase that writes it", found=found, expected=expected)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RecordError(path, f"not a valid {model.__name__} (schema_version {found}): {validation_problems(e)}",
                          found=found, expected=expected) from None
