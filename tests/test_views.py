"""The index and the comparison read runs of any decodescope version through typed views
(decodescope.schema.views), one read path each: the declared keys typed, any schema_version, a key of the
wrong type left at its default, a file that is not a JSON object refused naming it."""
import json
from pathlib import Path

import pytest

from decodescope.schema.recordbase import RecordError
from decodescope.schema.records import Bottleneck, Verdict, write_record
from decodescope.schema.records_manifest import RunManifest
from decodescope.schema.views import EntryView, HostView, ManifestView, ProfileSummaryView, VerdictView, read_view, view_of

REPORT = Path(__file__).parent.parent / "lib" / "decodescope" / "report"


def test_a_manifest_of_another_version_is_read_for_the_keys_the_index_uses(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps({"schema_version": 0, "run_id": "old", "status": "ok", "created": "2025-01-01",
                             "params": {"model": {"name": "m"}}, "phases": {"01_serving": {"status": "ok"}},
                             "a_key_of_that_version": [1, 2]}))
    v = read_view(p, ManifestView)
    assert (v.schema_version, v.run_id, v.status, v.params["model"]["name"]) == (0, "old", "ok", "m")
    assert v.phases == {"01_serving": EntryView(status="ok")} and v.variants == {}


def test_a_key_of_the_wrong_type_is_left_at_its_default_and_the_rest_is_kept():
    v = view_of({"run_id": "r", "status": 7, "phases": ["not", "a", "dict"], "host": {"hostname": "box"}},
                ManifestView)
    assert (v.run_id, v.status, v.phases, v.host.hostname) == ("r", None, {}, "box")
    # a nested view at fault drops its top-level key
    assert view_of({"bottleneck": {"class": "communication", "share": "most"}, "serving": {"tpot_p50_us": 4e3}},
                   VerdictView).model_dump() == {"schema_version": None, "bottleneck": None, "serving": {
                       "max_output_tok_s": None, "tpot_p50_us": 4e3, "lowest_level": None}}
    h = view_of({"gpus": [{"name": "NVIDIA H200"}, {"name": "NVIDIA H200", "uuid": "x"}], "has_gpu": True},
                HostView)
    assert [g.name for g in h.gpus] == ["NVIDIA H200"] * 2 and h.cpu is None


def test_the_verdict_view_reads_what_this_version_writes(tmp_path):
    write_record(tmp_path / "verdict.json", Verdict(bottleneck=Bottleneck(cls="communication", share=0.515)))
    v = read_view(tmp_path / "verdict.json", VerdictView)
    assert (v.bottleneck.cls, v.bottleneck.share) == ("communication", 0.515)
    # an older verdict spelt the class `cls`
    old = view_of({"schema_version": 1, "bottleneck": {"cls": "compute", "share": 0.4}}, VerdictView)
    assert old.bottleneck.cls == "compute"


def test_a_manifest_this_version_writes_reads_the_same_as_a_view(tmp_path):
    m = RunManifest(run_id="r1", params_name="p", params={"model": {"name": "m"}}, created="c", status="ok",
                    versions={"vllm": "0.32.0"}, git_commit="abc")
    write_record(tmp_path / "manifest.json", m)
    v = read_view(tmp_path / "manifest.json", ManifestView)
    assert (v.run_id, v.params_name, v.created, v.status, v.git_commit, v.versions) == \
        ("r1", "p", "c", "ok", "abc", {"vllm": "0.32.0"})


def test_a_profile_summary_row_without_its_keys_empties_the_categories_not_the_summary():
    s = view_of({"concurrency": 4, "per_step": {"wall_us_median": 12.0},
                 "per_step_categories": [{"rank": 0, "category": "gemm", "time_per_step_us": 5.0},
                                         {"category": "nccl"}]}, ProfileSummaryView)
    assert (s.concurrency, s.per_step_categories, s.per_step) == (4, [], {"wall_us_median": 12.0})


@pytest.mark.parametrize("content,problem", [(b"\xff\xfe", "unreadable"), (b"{not json", "not JSON"),
                                             (b"[1, 2]", "a JSON object was expected, found a list")])
def test_a_file_that_is_not_a_json_object_is_refused_naming_it(tmp_path, content, problem):
    p = tmp_path / "manifest.json"
    p.write_bytes(content)
    with pytest.raises(RecordError, match=problem) as e:
        read_view(p, ManifestView)
    assert str(p) in str(e.value)
    assert read_view(tmp_path / "absent.json", ManifestView) is None


def test_the_report_layer_reads_no_json_but_through_records_and_views():
    """One read path each: the index, the comparison and the report page read run files through
    decodescope.schema.records (this version's) or decodescope.schema.views (any version's)."""
    raw = [f"{f.name}:{n}" for f in sorted(REPORT.glob("*.py"))
           for n, line in enumerate(f.read_text().splitlines(), 1)
           if "json.load" in line or "read_json" in line]
    assert raw == []
