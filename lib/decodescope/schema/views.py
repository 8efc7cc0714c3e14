"""What the runs index and the comparison read of a run that any decodescope version wrote: a typed view
of each record they open, and one reader for all of them.

The index lists every run of an output folder and `decodescope compare` sets any two side by side, old
runs included, so they cannot refuse a file of another schema_version the way `read_record` does. A view
declares the keys they use, typed; it ignores every other key and the version. A key whose value has
the wrong type is left at its default, so an odd file still gives the rest of its row. Within a run, the
phases read their records through decodescope.schema.records, which refuses other versions.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from decodescope.schema.recordbase import RecordError


class _Part(BaseModel):
    """Declared keys only; any other key is ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class View(_Part):
    """A record as the index and the comparison read it: declared keys only, any schema_version."""

    schema_version: Optional[int] = None


V = TypeVar("V", bound=View)


def key_path(tree: Any, *keys: str) -> Any:
    """The value under keys in a key tree (a run's params or versions as recorded); None where a key is
    missing or a level is not a mapping."""
    for k in keys:
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


class ManifestHostView(_Part):
    hostname: Optional[str] = None


class EntryView(_Part):
    """A phase's or a variant's entry in manifest.json: its status, and a variant's params."""

    status: Optional[str] = None
    params: Optional[dict[str, Any]] = None


class ManifestView(View):
    """manifest.json: the run's identity and status, its params and versions as key trees, its phases'
    and variants' entries as the runner wrote them."""

    run_id: Optional[str] = None
    params_name: Optional[str] = None
    status: Optional[str] = None
    created: Optional[str] = None
    git_commit: Optional[str] = None
    host: ManifestHostView = Field(default_factory=ManifestHostView)
    params: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, Any] = Field(default_factory=dict)
    phases: dict[str, EntryView] = Field(default_factory=dict)
    variants: dict[str, EntryView] = Field(default_factory=dict)


class BottleneckView(_Part):
    cls: Optional[str] = Field(None, validation_alias=AliasChoices("class", "cls"))
    share: Optional[float] = None
    basis: Optional[str] = None  # critical path | summed op time; verdicts before it: summed op time
    category: Optional[str] = None
    level: Optional[int] = None


class ServingHeadlineView(_Part):
    max_output_tok_s: Optional[float] = None
    tpot_p50_us: Optional[float] = None
    lowest_level: Optional[float] = None


class VerdictView(View):
    """data/verdict.json: the bottleneck and the serving headline."""

    bottleneck: Optional[BottleneckView] = None
    serving: Optional[ServingHeadlineView] = None


class GpuNameView(_Part):
    name: str = "GPU"


class CpuNameView(_Part):
    hostname: Optional[str] = None


class EngineAllReduceView(_Part):
    """host.json's engine_allreduce: the all-reduce path the engine takes on this host."""

    path: Optional[str] = None
    communicator: Optional[str] = None
    gpu_communicators: list[str] = Field(default_factory=list)
    vllm: Optional[str] = None


class HostView(View):
    """data/host.json: the GPUs by name, whether there are any, the hostname, the engine's all-reduce path."""

    has_gpu: Optional[bool] = None
    gpus: list[GpuNameView] = Field(default_factory=list)
    cpu: Optional[CpuNameView] = None
    engine_allreduce: Optional[EngineAllReduceView] = None


class StepCategoryView(_Part):
    rank: int
    category: str
    time_per_step_us: float
    calls_per_step: Optional[float] = None


class ProfileSummaryView(View):
    """profile_summary.json: the level it profiled, the device, ranks and steps found, per rank and
    category the time and calls per step, and the step's own medians."""

    concurrency: Optional[int] = None
    device: Optional[str] = None
    ranks: Optional[list[int]] = None
    step_kind: Optional[str] = None
    steps: dict[str, Any] = Field(default_factory=dict)
    per_step_categories: list[StepCategoryView] = Field(default_factory=list)
    per_step: dict[str, Any] = Field(default_factory=dict)


def view_of(raw: dict, model: type[V]) -> V:
    """The view of a JSON object: each top-level key whose value does not validate (a nested view's
    included) is dropped and its default stands."""
    raw = dict(raw)
    while True:
        try:
            return model.model_validate(raw)
        except ValidationError as e:
            bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]} & set(raw)
            if not bad:
                raise
            for k in bad:
                del raw[k]


def read_view(path: Path, model: type[V]) -> Optional[V]:
    """The view of the record at path; None when there is no such file; RecordError (naming the file)
    when it is not a JSON object."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(path, f"unreadable ({e})") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise RecordError(path, f"not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise RecordError(path, f"a JSON object was expected, found a {type(raw).__name__}")
    return view_of(raw, model)
