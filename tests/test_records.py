"""Typed records: each file a phase writes round-trips through its model, and a file of another
schema_version, or one missing a field, is refused with an error naming the file."""
import fnmatch
import json
import tempfile
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError

from decodescope.exec import hardware
from decodescope.micro import bench as mb
from decodescope.core.io import ATOMIC_TMP_GLOB, _atomic_target, write_parquet_atomic
from decodescope.schema.params import load_params
from decodescope.schema.records import (LATENCY_FIT_COLUMNS, AttributionRow, Bottleneck, CollectivesFit, LatencyFit,
                                        ProfileSummary, ReconcileRow, RecordError, ServingHeadline, StepMedians,
                                        Verdict, read_record, write_record)
from decodescope.schema.records_host import CpuInfo, CpuMatmul, GpuInfo, HostInventory, Peaks, TopologyPair
from decodescope.schema.records_manifest import ManifestHost, PhaseEntry, RunManifest, Teardown
from decodescope.schema.records_serving import SERVING_LEVEL_COLUMNS, ServingLevel
from decodescope.schema.records_server import LinkMeasure, ProcessCores, ServerInfo
from decodescope.exec.runserver import write_server_info
from decodescope.exec.server import VllmServer
from decodescope.serving.metrics import level_summary, per_request
from decodescope.serving.remote import link_note

CPU = CpuInfo(model="Test CPU", logical_cores=2, physical_cores=2, numa_nodes=1, memory_gib=16.0, avx2=True,
              avx512f=False, amx=False, kernel="6.1", hostname="h")


def _peaks():
    return Peaks(name="H200", bf16_tflops=989.0, fp8_tflops=1979.0, mem_gbps=4800.0, link_gbps=450.0,
                 link="NVLink 4 (18 links)")


def _host():
    return HostInventory(
        has_gpu=True,
        gpus=[GpuInfo(index=i, name="NVIDIA H200", memory_mib=143771.0, max_sm_clock_mhz=1980.0,
                      max_mem_clock_mhz=3201.0, driver="570.1", pci_bus_id=f"0000:0{i}:00.0") for i in range(2)],
        topology_text="GPU0 GPU1\n", interconnect="nvlink",
        topology_pairs=[TopologyPair(gpu_a=a, gpu_b=b, code="X" if a == b else "NV18",
                                     link_class="self" if a == b else "nvlink", nvlinks=0 if a == b else 18)
                        for a in range(2) for b in range(2)],
        versions={"torch": "2.13.0", "cuda": "12.8", "cuda_available": True}, cpu=CPU, peaks=_peaks())


def _profile():
    return ProfileSummary(
        device="gpu", ranks=[0, 1], step_kind="decode", steps={"decode": 12, "prefill": 1},
        allreduce_share_of_time={0: 0.5, 1: 0.4}, allreduce_calls_per_step={0: 9.0, 1: 9.0},
        allreduce_mean_us={0: 20.0, 1: 18.0},
        per_step=StepMedians(summed_us_median=900.0, busy_us_median=850.0, wall_us_median=1000.0,
                             idle_us_median=150.0),
        expected_vs_observed=[{"rank": 0, "collective": "all_reduce", "expected_per_step": 9, "observed_per_step": 9.0,
                               "time_per_step_us": 450.0, "matches": True}],
        per_step_categories=[{"rank": r, "category": c, "calls_per_step": n, "calls_min": n, "calls_max": n,
                              "time_per_step_us": t, "steps": 12}
                             for r in (0, 1) for c, n, t in (("allreduce_nccl", 9.0, 450.0 - 50 * r),
                                                            ("gemm_dense", 20.0, 300.0), ("attention", 4.0, 100.0))],
        breakdown=[{"rank": 0, "category": "gemm_dense", "time_us": 3000.0, "share": 0.3, "calls": 200,
                    "mean_us": 15.0}],
        other_share=0.01, warnings=["rank 1 lost 2 events"])


def _verdict():
    return Verdict(
        sources={"attribution": "profile_summary.json (04_profile)"}, verdict="communication is the largest share",
        attribution=[AttributionRow(rank=0, cls="communication", time_per_step_us=450.0, share=0.53)],
        bottleneck=Bottleneck(cls="communication", share=0.53), wall_us=1000.0,
        reconcile=[ReconcileRow(piece="GEMMs per step", micro_benchmark_us=250.0, micro_source="gemm.parquet",
                                profile_us=None, profile_source="profile_summary.json")],
        serving=ServingHeadline(lowest_level=1, tpot_p50_us=1100.0, max_output_tok_s=900.0,
                                source="serving_levels.parquet (01_serving)"))


def _manifest():
    return RunManifest(run_id="20260101T000000Z-x", params_name="x", params_path="/p.yaml", params={"a": 1},
                       git_commit=None, versions={"python": "3.12"},
                       host=ManifestHost(kind="local", model="cpu", logical_cores=2, memory_gib=8.0, hostname="h"),
                       created="2026-01-01T00:00:00Z", status="running",
                       phases={"00_host": PhaseEntry(status="ok", duration_s=1.5, notebook="notebooks/00_host.ipynb"),
                               "05_verdict": PhaseEntry(status="pending")})


def _profile_capture():
    """What 04 writes for one level: its CaptureResult as a record (the writer's own path), with the
    host's CPU per step as procs.cpu_per_step gives it."""
    from decodescope.exec.procs import cpu_per_step
    from decodescope.profiling.capture import CaptureResult

    before = {10: ("worker", 1_000_000, 0), 11: ("engine core", 0, 0)}
    after = {10: ("worker", 5_000_000, 800_000), 11: ("engine core", 2_000_000, 3_000_000)}
    result = CaptureResult(Path("/tmp/traces/c1"), [Path("/tmp/traces/c1/rank0.pt.trace.json.gz")], [], [], 12, 0,
                           0.2, 3.5, 0.4, 1.1, expected_ranks=2, concurrency=1,
                           engine_itl_unprofiled_runs_us=[3_000.0, 3_300.0], engine_itl_profiled_us=3_600.0,
                           host_cpu_per_step=cpu_per_step(before, after, 1.0))
    rec = result.to_record()
    assert rec.role("worker").runq_wait_us == 800.0 and rec.role("api server").cpu_us == 0.0
    assert rec.engine_itl_unprofiled_us == 3_150.0 and rec.profiler_step_cost_us == 450.0
    return rec


LINK = LinkMeasure(host="root@gpu-box", n=20, via_tunnel_p50_ms=1.75, via_tunnel_p90_ms=2.5, on_host_p50_ms=0.5,
                   on_host_p90_ms=0.75, added_p50_ms=1.25)


def _server_info():
    """server.json as the runner writes it (write_server_info), read back through its record."""
    server = VllmServer("http://127.0.0.1:8000", run_token="feed" * 8)
    server.link, server.tree_pids = LINK, [4242, 4243]
    server.cores = {4242: {"role": "api server", "cpus": "0-1"}, 4243: {"role": "worker", "cpus": "1"}}
    with tempfile.TemporaryDirectory() as d:
        write_server_info(Path(d), server, load_params(Path(__file__).parent.parent / "params/default.yaml"))
        rec = read_record(Path(d) / "data/server.json", ServerInfo)
        assert read_record(Path(d) / "data/link.json", LinkMeasure) == LINK
    assert rec.owned is False and rec.pid is None and rec.model == "tiny-qwen3-moe"
    assert rec.cores["4243"] == ProcessCores(role="worker", cpus="1") and rec.link == LINK
    return rec


RECORDS = {
    "peaks": _peaks,
    "server_info": _server_info,
    "link": lambda: LINK,
    "profile_capture": _profile_capture,
    "host": _host,
    "cpu_host": lambda: HostInventory(has_gpu=False, cpu=CPU, cpu_matmul=[
        CpuMatmul(n=1024, dtype="float32", threads=2, reps=9, best_us=20000.0, gflops=107.4, method="torch.mm")]),
    "collectives_fit": lambda: CollectivesFit(fits=[
        LatencyFit(op="all_reduce", inplace=True, alpha_us=12.5, beta_gbps=8.0, points=11),
        LatencyFit(op="all_to_all", inplace=False, alpha_us=30.0, beta_gbps=math.inf, points=2)]),
    "profile_summary": _profile,
    "verdict": _verdict,
    "empty_verdict": Verdict,
    "manifest": _manifest,
}


def test_a_file_being_written_atomically_is_named_as_the_copies_between_hosts_leave_out(tmp_path):
    final, tmp = _atomic_target(tmp_path / "data" / "level_00001.parquet")
    assert tmp.parent == final.parent and tmp.is_file() and not final.exists()
    assert fnmatch.fnmatch(tmp.name, ATOMIC_TMP_GLOB) and tmp.name.startswith(".level_00001.parquet.")
    assert not fnmatch.fnmatch(final.name, ATOMIC_TMP_GLOB)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_record_round_trips(tmp_path, name):
    record = RECORDS[name]()
    path = write_record(tmp_path / f"{name}.json", record)
    back = read_record(path, type(record))
    assert back == record
    assert json.loads(path.read_text())["schema_version"] == type(record).expected_version() == 1


def test_on_disk_keys_use_the_aliases(tmp_path):
    doc = json.loads(write_record(tmp_path / "v.json", _verdict()).read_text())
    b = doc["bottleneck"]
    assert (b["class"], b["share"], b["basis"]) == ("communication", 0.53, "summed op time") and "cls" not in b
    assert doc["attribution"][0]["cls"] == "communication"


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_another_schema_version_is_refused_naming_the_file(tmp_path, name):
    record = RECORDS[name]()
    path = tmp_path / "data" / f"{name}.json"
    write_record(path, record)
    doc = json.loads(path.read_text())
    doc["schema_version"] = 2
    path.write_text(json.dumps(doc))
    with pytest.raises(RecordError) as e:
        read_record(path, type(record))
    msg = str(e.value)
    assert str(path) in msg and "schema_version 2 found" in msg and "schema_version 1" in msg
    assert type(record).__name__ in msg
    assert (e.value.found, e.value.expected, e.value.path) == (2, 1, path)
    assert isinstance(e.value, ValueError)


def test_profile_summary_rows_are_typed_and_its_rank_keys_ints(tmp_path):
    """The file keeps its shape (rank keys as JSON's strings); the record reads them as ints and each
    table row as its model, which refuses a key it does not declare."""
    path = write_record(tmp_path / "profile_summary.json", _profile())
    raw = json.loads(path.read_text())
    assert raw["allreduce_share_of_time"] == {"0": 0.5, "1": 0.4}
    back = read_record(path, ProfileSummary)
    assert back.allreduce_mean_us == {0: 20.0, 1: 18.0} and back.allreduce_mean_us.get(1) == 18.0
    assert back.per_step_categories[0].category == "allreduce_nccl" and back.breakdown[0].calls == 200
    raw["breakdown"][0]["typo_us"] = 1.0
    path.write_text(json.dumps(raw))
    with pytest.raises(RecordError, match=r"breakdown\.0\.typo_us"):
        read_record(path, ProfileSummary)


def test_recorded_profile_summaries_validate_and_write_back_byte_for_byte(tmp_path, repo):
    files = sorted((repo / "tests/fixtures/runs").glob("*/data/**/profile_summary.json"))
    assert len(files) >= 7
    for f in files:
        out = write_record(tmp_path / "profile_summary.json", read_record(f, ProfileSummary))
        assert out.read_bytes() == f.read_bytes(), f


def test_a_file_without_schema_version_is_refused(tmp_path):
    path = tmp_path / "profile_summary.json"
    doc = _profile().to_json_dict()
    del doc["schema_version"]
    path.write_text(json.dumps(doc))
    with pytest.raises(RecordError, match=r"profile_summary\.json: no schema_version found, .*ProfileSummary "
                                          r"schema_version 1"):
        read_record(path, ProfileSummary)


@pytest.mark.parametrize("name, field, where", [
    ("profile_summary", "ranks", "ranks"), ("host", "cpu", "cpu"), ("manifest", "run_id", "run_id"),
    ("verdict", "share", "bottleneck.share"), ("collectives_fit", "alpha_us", "fits.0.alpha_us"),
])
def test_a_missing_required_field_is_named(tmp_path, name, field, where):
    path = tmp_path / f"{name}.json"
    doc = RECORDS[name]().to_json_dict()
    parent = doc
    for key in where.split(".")[:-1]:
        parent = parent[int(key) if key.isdigit() else key]
    del parent[field]
    path.write_text(json.dumps(doc))
    with pytest.raises(RecordError) as e:
        read_record(path, type(RECORDS[name]()))
    assert str(path) in str(e.value) and f"{where}: Field required" in str(e.value)


def test_not_json_or_not_an_object_is_refused(tmp_path):
    bad = tmp_path / "verdict.json"
    bad.write_text("{trunc")
    with pytest.raises(RecordError, match="verdict.json: not JSON"):
        read_record(bad, Verdict)
    old = tmp_path / "collectives_fit.json"
    old.write_text(json.dumps([{"op": "all_reduce", "inplace": True, "alpha_us": 1.0, "beta_gbps": 1.0, "points": 3}]))
    with pytest.raises(RecordError, match="collectives_fit.json: a CollectivesFit record is a JSON object"):
        read_record(old, CollectivesFit)


def test_nested_peaks_of_another_version_are_refused(tmp_path):
    doc = _host().to_json_dict()
    doc["peaks"]["schema_version"] = 3
    path = tmp_path / "host.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RecordError, match=r"host.json: .*peaks.schema_version: .*schema_version 3 found"):
        read_record(path, HostInventory)


# ---- the writers produce their records ---------------------------------------------------------------
def test_host_inventory_of_this_host_round_trips(tmp_path):
    inv = hardware.inventory(measure_cpu=False)
    back = read_record(write_record(tmp_path / "host.json", inv), HostInventory)
    assert back == inv and back.cpu.logical_cores >= 1
    assert hardware.host_headline(back).startswith("**")
    tables = hardware.inventory_tables(_host())
    assert list(tables["peaks"].columns) == ["name", "bf16_tflops", "fp8_tflops", "mem_gbps", "link_gbps", "link",
                                             "source"]  # as the datasheet table always showed them
    assert tables["link_classes"].to_dict("records") == [{"link_class": "nvlink", "gpu_pairs": 1}]


def test_a_cpu_matmul_slower_than_its_budget_is_timed_once_after_its_warm_up():
    """00 times one call, not three, where one outlasts the budget (bf16 at 1024 on an AVX2 host: 2.2 s)."""
    m = hardware.measure_cpu_matmul_peak(n=64, dtype="float32", seconds=0.0)
    assert m.reps == 1 and m.best_us > 0 and m.gflops > 0
    assert m.method.endswith("best of 1 after one warm-up")


def _levels_requests():
    rows = []
    for level in (1, 2):
        for i in range(6):
            send = 1_000_000_000 * level + i * 10_000_000
            chunks = [send + 5_000_000 + k * 1_000_000 for k in range(8)]
            rows.append({"level": level, "warmup": i == 0, "ok": i != 5, "send_ns": send, "first_chunk_ns": chunks[0],
                         "end_ns": chunks[-1], "chunk_ns": chunks, "n_out_usage": 8.0, "n_out_chunks": 8,
                         "n_in_usage": 16.0, "n_in_sent": 16, "error_class": None if i != 5 else "timeout"})
    return per_request(pd.DataFrame(rows))


def test_serving_level_rows_are_the_declared_columns_and_round_trip_through_parquet(tmp_path):
    req = _levels_requests()
    health = {"loop_lag_p50_ms": 0.1, "loop_lag_p99_ms": 0.4, "loop_lag_max_ms": 1.0, "client_cpu_pct": 20.0,
              "inflight_sampled_mean": 1.2, "engine_silence_ms": 1900.0, "engine_stall_ms": 1900.0}
    text = {"gpu_throttle_reasons": "sw_power_cap", "server_spec_accepted_per_pos": "0.3370,0.2784"}
    telemetry = {c: text[c] if c in text else 3 if c.startswith("telemetry_") else 1.5
                 for c in SERVING_LEVEL_COLUMNS if c.startswith(("server_", "gpu_", "telemetry_"))}
    rows = [level_summary(req.assign(repeat=0), lvl, {"ttft_ms": 100}, health, repeat=0, telemetry=telemetry)
            for lvl in (1, 2)]
    # every column, in the declared order, but those only the merge of repeats sets (count and bands)
    merged_only = [c for c in SERVING_LEVEL_COLUMNS if c == "repeats" or c.endswith(("_low", "_high"))]
    assert list(rows[0]) == [c for c in SERVING_LEVEL_COLUMNS if c not in merged_only]
    bare = level_summary(req, 1)  # no repeats, SLO or client health: those columns are left out, as before
    assert list(bare) == [c for c in SERVING_LEVEL_COLUMNS if c in bare]
    assert "goodput_rps" not in bare and "client_suspect" not in bare and "repeat" not in bare
    assert bare["ok"] == 4 and bare["failed"] == 1 and bare["failure_reasons"] == "timeout: 1"
    path = write_parquet_atomic(tmp_path / "serving_levels.parquet", pd.DataFrame(rows))
    back = [ServingLevel.model_validate(r) for r in pd.read_parquet(path).to_dict("records")]
    assert back == [ServingLevel.model_validate(r) for r in rows]
    assert back[0].client_suspect is False and back[0].tpot_p50_us == pytest.approx(1000.0)


def test_latency_fit_declares_its_columns_and_its_file_round_trips(tmp_path):
    sizes = np.array([1024, 4096, 16384, 65536], dtype=float)
    sweep = pd.DataFrame({"part": "sweep", "status": "ok", "rank": 0, "op": "all_reduce", "inplace": True,
                          "bytes": sizes, "time_us": 10.0 + sizes / 2e3})
    fit = mb.latency_fit(sweep)
    assert list(fit.columns) == LATENCY_FIT_COLUMNS
    assert fit["alpha_us"].iloc[0] == pytest.approx(10.0) and fit["beta_gbps"].iloc[0] == pytest.approx(2.0)
    assert list(mb.latency_fit(sweep.iloc[:1]).columns) == LATENCY_FIT_COLUMNS  # nothing to fit: still the columns
    mb.save_collectives(sweep, fit, tmp_path)
    on_disk = read_record(tmp_path / "collectives_fit.json", CollectivesFit)
    assert [f.model_dump() for f in on_disk.fits] == fit.to_dict("records")


def test_gemm_peaks_come_from_host_json(tmp_path, repo):
    params = load_params(repo / "params/default.yaml")
    (tmp_path / "data").mkdir()
    assert mb.peaks_for(tmp_path, params) is None  # no host.json, no GPU named: no peaks
    write_record(tmp_path / "data/host.json", RECORDS["cpu_host"]())
    peaks = mb.peaks_for(tmp_path, params)
    assert peaks.name == "CPU (measured)" and peaks.fp32_tflops == pytest.approx(0.1074)
    rows = [{"op": "qkv", "dtype": d, "count": 2, "tflops": 0.05, "gbps": 10.0, "time_us": 3.0}
            for d in ("fp32", "bf16")]
    g = mb.gemm_table(rows, peaks)
    assert g["peak_tflops"].iloc[0] == pytest.approx(0.1074) and math.isnan(g["peak_tflops"].iloc[1])
    write_record(tmp_path / "data/host.json", _host())
    g = mb.gemm_table(rows, mb.peaks_for(tmp_path, params))
    assert math.isnan(g["peak_tflops"].iloc[0]) and g["peak_tflops"].iloc[1] == 989.0  # no fp32 datasheet peak
    assert "of H200" in g["peak_source"].iloc[1] and g["mem_gbps"].iloc[0] == 4800.0


def test_verdict_from_the_phases_files_round_trips(tmp_path, repo):
    from decodescope.report import sections
    from decodescope.verdict.verdict import verdict

    params = load_params(repo / "params/default.yaml")
    data = tmp_path / "data"
    write_record(data / "profile_summary.json", _profile())
    req = _levels_requests()
    write_parquet_atomic(data / "serving_levels.parquet", pd.DataFrame([level_summary(req, lvl) for lvl in (1, 2)]))
    v = verdict(tmp_path, params)
    assert v.bottleneck.cls == "communication" and v.wall_us == 1000.0
    assert v.serving.lowest_level == 1 and v.serving.tpot_p50_us == pytest.approx(1000.0)
    assert {a.cls for a in v.attribution} == {"communication", "gemm", "attention"}
    assert v.verdict.startswith("communication is the largest share") and "rank 0 50%" in v.verdict
    assert read_record(write_record(data / "verdict.json", v), Verdict) == v
    for show in (sections.verdict_headline, sections.verdict_attribution, sections.verdict_reconcile,
                 sections.verdict_serving):
        show(v)
    empty = verdict(tmp_path / "nothing", params)
    assert empty.verdict is None and empty.projections == [] and empty.serving is None


def test_the_manifest_keeps_its_keys_and_refuses_another_version(tmp_path, repo):
    from decodescope.orchestration.runmanifest import Manifest, RunError

    params = load_params(repo / "params/default.yaml")
    m = Manifest.create(tmp_path, params, ["00_host", "05_verdict"])
    m.update_phase("00_host", status="running", start="t0", end=None, error=None)
    m.record.teardowns = [Teardown(at="t1", signalled=3, shm_removed=1, left=[])]
    setattr(m.record, "something_new", {"kept": True})  # a key of another version: kept as it is
    m.save()
    doc = json.loads((tmp_path / "manifest.json").read_text())
    assert list(doc)[:2] == ["schema_version", "run_id"]
    assert doc["phases"] == {"00_host": {"status": "running", "start": "t0", "end": None, "error": None},
                             "05_verdict": {"status": "pending"}}
    assert doc["host"]["kind"] == "local" and doc["something_new"] == {"kept": True}
    assert "resumed" not in doc and "server" not in doc  # no key filled in that the runner did not set
    loaded = Manifest.load(tmp_path)
    assert loaded.record.to_json_dict() == doc and loaded.record.phases["00_host"].status == "running"
    assert loaded.phase("05_verdict").model_dump(exclude_unset=True) == {"status": "pending"}
    # a value of the wrong type fails where the runner sets it, naming the field, before any file is written
    with pytest.raises(ValidationError, match="duration_s"):
        loaded.update_phase("00_host", duration_s="soon")
    with pytest.raises(ValidationError, match="status"):
        loaded.record.status = None  # type: ignore[assignment]
    assert json.loads((tmp_path / "manifest.json").read_text()) == doc
    # a variant's entry is the record's own: what the runner sets on it reaches the file, however many are added
    from decodescope.orchestration.runmanifest import set_fields

    first = loaded.variant("spec-ngram")
    set_fields(first, status="running", start="t2")
    set_fields(loaded.variant("eager"), status="failed", error="server did not start")
    set_fields(first, status="ok", duration_s=1.5)
    assert loaded.variant("spec-ngram") is loaded.record.variants["spec-ngram"]
    loaded.save()
    variants = json.loads((tmp_path / "manifest.json").read_text())["variants"]
    assert variants == {"spec-ngram": {"status": "ok", "start": "t2", "duration_s": 1.5},
                        "eager": {"status": "failed", "error": "server did not start"}}
    doc.pop("schema_version")
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(RunError, match=r"manifest\.json: no schema_version found"):
        Manifest.load(tmp_path)


def test_reconcile_pairs_the_profiles_communicator_with_the_same_one_in_the_probe(tmp_path):
    """Like for like: vLLM's shm all-reduce in the profile against the probe's vllm_shm burst, not gloo;
    a communicator the probe did not measure is stated, not divided."""
    from decodescope.verdict.verdict import allreduce_reconcile_row
    from decodescope.schema.records import ProfileSummary, StepMedians

    coll = pd.DataFrame([
        {"part": "burst", "status": "ok", "communicator": "torch_gloo", "mode": "eager", "batch": 2, "time_us": 17453.0},
        {"part": "burst", "status": "ok", "communicator": "vllm_shm", "mode": "eager", "batch": 2, "time_us": 190.0},
    ])
    summary = ProfileSummary(device="cpu", ranks=[0, 1], step_kind="decode", steps={}, allreduce_share_of_time={},
                             allreduce_calls_per_step={}, allreduce_mean_us={}, other_share=0.0,
                             allreduce_communicators={"vllm_shm": 1.0}, per_step=StepMedians())
    row = allreduce_reconcile_row(coll, summary, observed_us=200.0, batch=2)
    assert row["micro_benchmark_us"] == 190.0 and "vllm_shm" in row["micro_source"]  # burst: no sweep
    # with 03's back-to-back sweep: calls per step x the latency at the step's message size
    from decodescope.model import arch as archmod
    from decodescope.schema.params import load_params

    arch = archmod.normalize_config(load_params(Path(__file__).resolve().parents[1] / "params/default.yaml")
                                    .model_config_dict())
    sweep = pd.DataFrame([{"part": "sweep", "status": "ok", "op": "all_reduce", "communicator": c, "timing": t,
                           "inplace": True, "rank": 0, "bytes": n, "time_us": us, "p10_us": us, "p90_us": us}
                          for c, t, us in (("vllm_shm", "back_to_back", 3.5), ("vllm_shm", "isolated", 9.0),
                                           ("torch_gloo", "back_to_back", 1500.0)) for n in (512, 1024, 4096)])
    row = allreduce_reconcile_row(pd.concat([coll, sweep]), summary, observed_us=30.0, batch=2, arch=arch, tp=2)
    assert row["micro_benchmark_us"] == pytest.approx(9 * 3.5)  # 1 + 2 x 4 all-reduces of 1,024 B
    assert "vllm_shm back_to_back" in row["micro_source"]
    other = summary.model_copy(update={"allreduce_communicators": {"vllm_custom_ar": 1.0}})
    row = allreduce_reconcile_row(coll, other, observed_us=200.0, batch=2)
    assert np.isnan(row["micro_benchmark_us"]) and "not compared" in row["note"]


@pytest.mark.parametrize("name, comm", [
    ("_C::shm_allreduce", "vllm_shm"),                                   # vLLM CPU (csrc/cpu/shm.cpp)
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(...)", "vllm_custom_ar"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
    ("c10d::allreduce_", "torch_gloo"),                                  # torch.distributed on gloo (CPU)
])
def test_the_communicator_is_read_from_the_op_name(name, comm):
    from decodescope.trace.categorize import communicator_of

    assert communicator_of(name) == comm


def test_each_serving_level_is_set_against_the_nearest_profiled_level_and_flagged_with_a_cause():
    from decodescope.schema.records import ProfileSummary, StepMedians
    from decodescope.verdict.verdict import level_reconcile

    def summary(conc, period):
        return ProfileSummary(device="cpu", ranks=[0, 1], step_kind="decode", steps={}, allreduce_share_of_time={},
                              allreduce_calls_per_step={}, allreduce_mean_us={}, other_share=0.0, concurrency=conc,
                              per_step=StepMedians(wall_us_median=period - 1_000.0, idle_us_median=900.0,
                                                   period_us_median=period))
    levels = pd.DataFrame({"level": [1, 2, 4], "tpot_p50_us": [4_200.0, 4_500.0, 5_500.0],
                           "itl_coalesced_frac": [0.25, 0.0, 0.1]})
    # profiled at 1 (period 4.0 ms) and 2 (4.4 ms): level 4 is set against level 2, the nearest
    rows = {r["level"]: r for r in level_reconcile(levels, {1: summary(1, 4_000.0), 2: summary(2, 4_400.0)},
                                                   model={1.0: (4_620.0, 4_000.0, 5_000.0)})}
    assert rows[1]["profile_batch"] == 1 and rows[1]["residual_us"] == pytest.approx(200.0) and rows[1]["within_tolerance"]
    assert rows[2]["profile_batch"] == 2 and rows[2]["within_tolerance"] and rows[2]["attributed_to"] == ""
    four = rows[4]  # 5.5 ms vs 4.4 ms: 25% off
    assert four["profile_batch"] == 2 and not four["within_tolerance"] and four["residual_us"] == pytest.approx(1_100.0)
    assert "batch 4 vs the nearest profiled level 2" in four["attributed_to"]
    assert rows[1]["model_us"] == 4_620.0 and rows[1]["model_error"] == pytest.approx(0.10)
    assert rows[2].get("model_us") is None
    assert level_reconcile(levels, {}, {})[0].get("profile_wall_us") is None  # no profile: nothing divided


def test_a_level_whose_tokens_arrived_in_bursts_is_set_against_the_engines_own_tpot():
    from types import SimpleNamespace

    from decodescope.verdict.verdict import level_tpot

    steady = SimpleNamespace(tpot_p50_us=3_000.0, itl_coalesced_frac=0.1, server_tpot_mean_us=2_900.0)
    assert level_tpot(steady) == (3_000.0, "client TPOT p50")
    bursts = SimpleNamespace(tpot_p50_us=7.4, itl_coalesced_frac=0.99, server_tpot_mean_us=2_876.0)
    tpot, why = level_tpot(bursts)
    assert tpot == 2_876.0 and "99% of the client's token gaps coalesced" in why
    no_metrics = SimpleNamespace(tpot_p50_us=7.4, itl_coalesced_frac=0.99, server_tpot_mean_us=float("nan"))
    assert level_tpot(no_metrics)[0] == 7.4   # nothing better measured: the client's, as it is


def test_a_level_whose_engine_stalled_is_set_against_its_tpot_with_the_stall_out():
    """The H100 baseline at concurrency 32 (2026-12-07): a 748 ms stall in 18 of its 32 streams read TPOT p50
    12,580 us; without it 6,738 us (ITL p50 6,730 us); a level that ran through keeps its p50."""
    from types import SimpleNamespace

    from decodescope.verdict.verdict import level_tpot

    stalled = SimpleNamespace(tpot_p50_us=12_580.2, itl_coalesced_frac=0.0, server_tpot_mean_us=10_030.0,
                              engine_stall_ms=747.6, tpot_unstalled_p50_us=6_737.8)
    tpot, why = level_tpot(stalled)
    assert tpot == 6_737.8 and why == "client TPOT p50 with the engine's 0.75 s stall taken out (p50 as read: 12,580 us)"
    ran_through = SimpleNamespace(tpot_p50_us=3_809.8, itl_coalesced_frac=0.0, server_tpot_mean_us=3_803.6,
                                  engine_stall_ms=float("nan"), tpot_unstalled_p50_us=3_809.8)
    assert level_tpot(ran_through) == (3_809.8, "client TPOT p50")


def test_a_verdict_written_with_the_fixed_factor_view_is_still_read_without_it(tmp_path):
    """verdict.json of earlier runs held `what_if` (fixed factors on the profiled shares), since removed: the
    step model's projections are the one projection engine."""
    old = _verdict().model_dump(mode="json", by_alias=True)
    old["what_if"] = [{"what_if": "GEMMs 2x faster", "step_us": 850.0, "saved_us": 150.0, "speedup_x": 1.18,
                       "tok_s_per_sequence": 1176.5}]
    (tmp_path / "verdict.json").write_text(json.dumps(old))
    v = read_record(tmp_path / "verdict.json", Verdict)
    assert v == _verdict() and "what_if" not in v.model_dump()


def test_the_link_note_reads_the_tunnels_cost_from_its_record(tmp_path, repo):
    params = load_params(repo / "params/default.yaml")
    assert link_note(tmp_path, params) == ""  # a local host writes no link.json
    write_record(tmp_path / "link.json", LINK)
    note = link_note(tmp_path, params)
    assert "server runs on root@gpu-box" in note and "adds about 1.25 ms" in note
    assert "p50 1.75 ms through the tunnel, 0.50 ms on the host itself, 20 round trips" in note
    write_record(tmp_path / "link.json", LINK.model_copy(update={"on_host_p50_ms": None, "added_p50_ms": None}))
    assert "adds about nan ms" in link_note(tmp_path, params)  # the host answered none of its round trips
    (tmp_path / "link.json").write_text(json.dumps({"host": "h", "n": 3}))
    with pytest.raises(RecordError, match="link.json.*no schema_version"):
        link_note(tmp_path, params)
