"""The probes' outputs through their record (decodescope.schema.records_probe): written as each part finishes, read
back by 02 and 03 with an error that names the file and the row at fault; files written before the record
still read."""
import json
import subprocess
import sys

import pytest

from decodescope.schema.records import RecordError
from decodescope.core.probefile import write_probe_output
from decodescope.schema.records_probe import ProbeOutput, read_probe_output, read_probe_rows

STEP_ROW = {"batch": 1, "variant": "full", "mode": "eager", "status": "ok", "time_us": 812.5, "rank": 0}


def test_a_probe_output_round_trips_with_its_version_and_probe(tmp_path):
    meta = {"rank": 1, "world_size": 2, "backend": "gloo"}
    path = write_probe_output(tmp_path / "step_rank1.json", "step", [STEP_ROW], meta)
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == ProbeOutput.expected_version() == 1 and doc["probe"] == "step"
    back = read_probe_output(path, "step")
    assert back.meta == meta and back.rows == [STEP_ROW]


def test_files_written_before_the_record_read_as_version_1(tmp_path):
    # gemm_raw.json was a bare list of rows; the ranks' files an object of meta and rows
    gemm = tmp_path / "gemm_raw.json"
    gemm.write_text(json.dumps([{"op": "qkv", "dtype": "bf16", "status": "ok", "time_us": 3.0}]))
    assert read_probe_output(gemm, "gemm").rows[0]["time_us"] == 3.0
    ranks = [tmp_path / f"step_rank{r}.json" for r in (0, 1)]
    for r, p in enumerate(ranks):
        p.write_text(json.dumps({"meta": {"rank": r}, "rows": [{**STEP_ROW, "rank": r}]}))
    assert [row["rank"] for row in read_probe_rows(ranks, "step")] == [0, 1]


def test_a_row_without_a_key_its_readers_need_is_named_with_the_file(tmp_path):
    path = write_probe_output(tmp_path / "collectives_rank0.json", "collectives",
                              [{"part": "burst", "op": "all_reduce", "status": "ok"}, {"part": "sweep", "status": "ok"}],
                              {"backend": "gloo"})
    with pytest.raises(RecordError) as e:
        read_probe_output(path, "collectives")
    assert str(path) in str(e.value) and "rows[1] lacks op" in str(e.value), e.value


@pytest.mark.parametrize("text, says", [
    ("{not json", "not JSON"),
    ('"a string"', "found a str"),
    ('{"schema_version": 2, "probe": "gemm", "rows": []}', "schema_version"),
    ('{"probe": "collectives", "meta": {}, "rows": []}', "written by the 'collectives' probe"),
])
def test_a_file_that_is_not_this_probes_output_is_refused_naming_it(tmp_path, text, says):
    path = tmp_path / "gemm_raw.json"
    path.write_text(text)
    with pytest.raises(RecordError) as e:
        read_probe_output(path, "gemm")
    assert str(path) in str(e.value) and says in str(e.value), e.value


@pytest.mark.integration  # the GEMM probe under torch, as a process of its own: make test, not test-fast
def test_the_gemm_probe_writes_its_record_and_02_reads_it(tmp_path):
    """The real probe (torch on this CPU, one small shape) writes the record, which reads back whole."""
    shapes = [{"op": "o_proj", "m": 1, "n": 64, "k": 64, "dtype": "fp32", "batch": 1, "count": 2, "groups": 1,
               "tp": 1}]
    (tmp_path / "shapes.json").write_text(json.dumps(shapes))
    out = tmp_path / "gemm_raw.json"
    proc = subprocess.run([sys.executable, "-m", "decodescope.probes.gemm", "--shapes", str(tmp_path / "shapes.json"),
                           "--out", str(out), "--iters", "3", "--warmup", "1", "--device", "cpu", "--no-graph"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = read_probe_output(out, "gemm")
    assert doc.probe == "gemm" and len(doc.rows) == 1
    assert doc.rows[0]["op"] == "o_proj" and doc.rows[0]["status"] == "ok" and doc.rows[0]["time_us"] > 0


def test_the_probes_import_without_pydantic_or_pandas():
    """A GPU host's image may have torch and nothing else of decodescope's dependencies: the probes and their
    writer import with pydantic and pandas blocked."""
    code = ("import sys\n"
            "for m in ('pydantic', 'pandas'):\n"
            "    sys.modules[m] = None  # an import of it now fails\n"
            "import decodescope.probes.gemm, decodescope.probes.collectives, decodescope.probes.step\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
