"""`decodescope compare` and the statistics of repeats: the page's sections, the differences against
numbers worked out here, significance with repeats made to differ or not, missing phases named, bad
paths refused with exit status 2, hostile strings shown as text, and the page in a real browser."""
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from decodescope.core import stats
from decodescope.cli.main import main
from decodescope.core.io import write_parquet_atomic
from decodescope.schema.params import load_params, params_as_dict
from decodescope.schema.records import ProfileSummary, StepMedians, write_record
from decodescope.schema.records_manifest import RunManifest
from decodescope.report import compare
from decodescope.orchestration.runmanifest import RunError
from decodescope.serving.metrics import level_summary, per_request

REPO = Path(__file__).resolve().parents[1]
HOSTILE = "<script>window.__ds_pwned='params'</script>"


# ---- run directories, written the way the phases write them ------------------------------------------
def _requests(level: int, tpot_us: int, repeat=None, n: int = 4, n_out: int = 9, ttft_us: int = 5_000) -> list[dict]:
    """n requests one after the other, each with exactly this TPOT (integer us: no rounding)."""
    rows, t = [], 10_000_000_000 * level + 1_000_000_000 * (repeat or 0)
    for i in range(n):
        send = t + i * 100_000_000
        chunks = [send + ttft_us * 1000 + k * tpot_us * 1000 for k in range(n_out)]
        rows.append({"level": level, "index": i, "warmup": False, "ok": True, "error_class": None, "error_text": None,
                     "send_ns": send, "first_chunk_ns": chunks[0], "end_ns": chunks[-1], "chunk_ns": chunks,
                     "n_out_usage": n_out, "n_out_chunks": n_out, "n_in_usage": 16, "n_in_sent": 16,
                     "connect_us": 100.0, **({} if repeat is None else {"repeat": repeat})})
    return rows


def write_serving(data: Path, tpots: dict[int, list[int]], repeats: bool) -> pd.DataFrame:
    """serving_requests/levels.parquet from requests, through metrics.level_summary, as the sweep writes
    them: per level one row; with repeats, serving_levels_repeats.parquet one row per (level, repeat)
    and serving_levels.parquet their medians (sweep.merge_repeats)."""
    from decodescope.serving.sweep import merge_repeats

    raw = [r for level, per in tpots.items() for i, tp in enumerate(per)
           for r in _requests(level, tp, i if repeats else None)]
    req = per_request(pd.DataFrame(raw))
    rows = ([level_summary(req, level, repeat=i) for level, per in tpots.items() for i in range(len(per))]
            if repeats else [level_summary(req, level) for level in tpots])
    write_parquet_atomic(data / "serving_requests.parquet", req)
    levels = pd.DataFrame(rows)
    if repeats:
        write_parquet_atomic(data / "serving_levels_repeats.parquet", levels)
        write_parquet_atomic(data / "serving_levels.parquet", merge_repeats(levels))
    else:
        write_parquet_atomic(data / "serving_levels.parquet", levels)
    return levels


def write_profile(data: Path, categories: dict[str, list[tuple[float, float]]], wall_us: float) -> None:
    """profile_summary.json with per-rank (time us, calls) per category; None for a rank without it."""
    rows = [{"rank": rank, "category": cat, "calls_per_step": per[1], "calls_min": per[1], "calls_max": per[1],
             "time_per_step_us": per[0], "steps": 10}
            for cat, ranks in categories.items() for rank, per in enumerate(ranks) if per is not None]
    write_record(data / "profile_summary.json", ProfileSummary(
        device="cpu", ranks=[0, 1, 2], step_kind="decode", steps={"decode": 30}, allreduce_share_of_time={},
        allreduce_calls_per_step={}, allreduce_mean_us={}, per_step=StepMedians(wall_us_median=wall_us,
                                                                                 summed_us_median=wall_us * 0.8),
        per_step_categories=rows, other_share=0.0))


def write_gemm(data: Path, scale: float) -> None:
    write_parquet_atomic(data / "gemm.parquet", pd.DataFrame(
        [{"op": op, "dtype": "bf16", "l2": "warm", "batch": b, "status": "ok", "time_us": base * b ** 0.5 * scale}
         for op, base in (("qkv_proj", 10.0), ("o_proj", 8.0)) for b in (1, 2, 4)]))


def write_collectives(data: Path, scale: float) -> None:
    write_parquet_atomic(data / "collectives.parquet", pd.DataFrame(
        [{"part": "sweep", "op": "all_reduce", "communicator": "torch_gloo", "rank": rank, "world_size": 2,
          "mode": "eager", "timing": "back_to_back", "inplace": True, "bytes": n, "status": "ok",
          "time_us": (20.0 + n / 1e3) * scale * (1 + rank)} for rank in (0, 1) for n in (1024, 4096, 16384)]))


def make_run(root: Path, name: str, *, tp: int = 2, note: str = "plain", tpots=None, repeats: bool = False,
             categories=None, wall_us: float = 1000.0, gemm_scale=1.0, coll_scale=1.0,
             statuses: dict = None) -> Path:
    d = root / name
    (d / "data").mkdir(parents=True)
    params = params_as_dict(load_params(REPO / "params" / "default.yaml"))
    params["run"]["name"] = name.split("-", 1)[-1]
    params["server"]["tensor_parallel"] = tp
    params["server"]["engine_args"]["note"] = note
    (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    statuses = {p: "ok" for p in ("00_host", "01_serving", "02_gemm", "03_collectives", "04_profile",
                                  "05_verdict")} | (statuses or {})
    write_record(d / "manifest.json", RunManifest(
        run_id=name, params_name=params["run"]["name"], params=params, created="2026-01-01T00:00:00Z", status="ok",
        versions={"vllm": "0.32.0", "torch": "2.13.0"}, git_commit="abc",
        phases={p: {"status": s} for p, s in statuses.items()}))
    if tpots is not None:
        write_serving(d / "data", tpots, repeats)
    if categories is not None:
        write_profile(d / "data", categories, wall_us)
    if gemm_scale is not None:
        write_gemm(d / "data", gemm_scale)
    if coll_scale is not None:
        write_collectives(d / "data", coll_scale)
    return d


# per rank (time per step us, calls per step); worked out by hand below
CATS_A = {"gemm": [(100, 10), (120, 10), (110, 10)], "allreduce": [(50, 9), (150, 9), (80, 9)],
          "attention": [(30, 4), (40, 4), None]}
CATS_B = {"gemm": [(90, 10), (100, 10), (95, 10)], "allreduce": [(20, 9), (40, 9), (30, 9)],
          "moe_experts": [(10, 2), (12, 2), (11, 2)]}
EXPECTED = {  # category: (A time, B time, A calls, B calls), the median over the three ranks, a missing rank 0
    "gemm": (110, 95, 10, 10), "allreduce": (80, 30, 9, 9), "attention": (30, 0, 4, 0), "moe_experts": (0, 11, 0, 2)}


@pytest.fixture
def two_runs(tmp_path):
    out = tmp_path / "outputs"
    a = make_run(out, "20260101T000000Z-base", tpots={1: [4000], 2: [5000]}, categories=CATS_A, wall_us=1000)
    b = make_run(out, "20260102T000000Z-new", tp=4, note=HOSTILE, tpots={1: [3000], 2: [5200]},
                 categories=CATS_B, wall_us=800, gemm_scale=0.5, coll_scale=2.0)
    return a, b


# ---- stats -----------------------------------------------------------------------------------------
def test_one_measurement_has_no_band_and_says_so():
    b = stats.band([4.2])
    assert (b.n, b.median, b.low, b.high, b.method) == (1, 4.2, None, None, stats.NO_REPEATS)
    assert stats.band([]).median is None and stats.band([None, float("nan")]).n == 0
    d = stats.differ([1.0], [2.0, 2.1, 2.2])
    assert d.call == stats.NO_REPEATS and d.delta == pytest.approx(1.1) and d.low is None


def test_band_is_the_bootstrap_of_the_median_with_a_fixed_seed():
    values = [10.0, 11.0, 9.5, 10.4, 30.0]
    b = stats.band(values)
    assert b.median == 10.4 and b.n == 5 and b.method == stats.METHOD
    assert 9.5 <= b.low <= b.median <= b.high <= 30.0
    assert stats.band(values) == b   # the same repeats give the same band, every time
    assert stats.band([7.0, 7.0, 7.0]).as_dict() | {"method": ""} == {"n": 3, "median": 7.0, "low": 7.0,
                                                                        "high": 7.0, "method": ""}


def test_differ_calls_separated_repeats_significant_and_overlapping_ones_noise():
    assert stats.differ([10.0, 10.2, 9.9], [12.0, 12.3, 11.8]).call == stats.SIGNIFICANT
    assert stats.differ([10.0, 10.2, 9.9], [8.0, 8.1, 7.9]).call == stats.SIGNIFICANT   # faster is a difference too
    same = stats.differ([10.0, 10.5, 9.5, 10.2], [10.1, 9.6, 10.6, 9.9])
    assert same.call == stats.WITHIN_NOISE and same.low < 0 < same.high
    assert stats.differ([10.0, 10.2], [12.0, 12.3]).call == stats.TOO_FEW   # 2 a side: never called
    d = stats.differ([10.0, 10.2, 9.9], [12.0, 12.3, 11.8])
    assert d.delta == pytest.approx(2.0) and d.delta_pct == pytest.approx(20.0) and d.low <= 2.0 <= d.high


def test_pure_noise_is_called_significant_as_rarely_as_the_docstring_says():
    rng = np.random.default_rng(7)
    rate = {n: np.mean([stats.differ(rng.normal(size=n), rng.normal(size=n)).call == stats.SIGNIFICANT
                        for _ in range(300)]) for n in (3, 5)}
    assert 0.03 < rate[3] < 0.18   # non-overlapping triples: 2/20 under exchangeable noise
    assert rate[5] <= 1 / 15


def test_frames_in_and_out():
    df = pd.DataFrame({"level": [1, 1, 1, 2], "v": [1.0, 2.0, 3.0, 5.0]})
    bands = stats.band_frame(df, ["level"], "v")
    assert list(bands["n"]) == [3, 1] and list(bands["median"]) == [2.0, 5.0]
    d = stats.differ_frame(df, df.assign(v=df["v"] + 100), ["level"], "v")
    assert list(d["call"]) == [stats.SIGNIFICANT, stats.NO_REPEATS] and list(d["delta"]) == [100.0, 100.0]


# ---- the page --------------------------------------------------------------------------------------
def test_the_page_has_every_section_and_is_listed_by_the_index(two_runs):
    a, b = two_runs
    page = compare.build_compare([str(a), str(b)])
    assert page == a.parent / "compare" / f"{a.name}-vs-{b.name}.html"
    html = page.read_text()
    for section in ("decodescope compare", "Params and versions", "Serving (01)", "The decode step by category (04)",
                    "Micro-benchmarks (02, 03)", "Output throughput vs concurrency",
                    "TPOT p50 vs output tokens", "Time per decode step by category",
                    "Difference per category against the base", "GEMM time per call",
                    "Collective time: difference against the base", "phase status"):
        assert section in html, section
    assert html.count("Plotly.newPlot") == 6
    assert not re.search(r"<script[^>]+src=", html) and not re.search(r"<link[^>]+href=\"https?:", html)
    assert 'href="../20260101T000000Z-base/report.html"' not in html   # no report in these runs: no link
    index = (a.parent / "index.html").read_text()
    assert f'href="compare/{page.name}"' in index


def test_params_and_versions_differences_are_listed(two_runs):
    sources = compare.load_sources(two_runs)
    p = compare.params_diff(sources).set_index("key")
    assert p.loc["server.tensor_parallel", "A"] == "2" and p.loc["server.tensor_parallel", "B"] == "4"
    assert p.loc["server.engine_args.note", "B"] == HOSTILE
    assert "workload.input_tokens" not in p.index   # the same in both: not listed
    assert compare.versions_diff(sources).empty
    assert [s.tensor_parallel for s in sources] == [2, 4]


def test_differences_per_category_are_the_median_over_ranks(two_runs):
    sources = compare.load_sources(two_runs)
    diffs = compare.category_differences({s.letter: compare.profile_summaries(s)[None] for s in sources})
    got = diffs.set_index("category")
    assert set(got.index) == set(EXPECTED)
    for cat, (ta, tb, ca, cb) in EXPECTED.items():
        row = got.loc[cat]
        assert (row["time_a_us"], row["time_b_us"]) == (pytest.approx(ta), pytest.approx(tb)), cat
        assert row["delta_us"] == pytest.approx(tb - ta), cat
        assert (row["calls_a"], row["calls_b"], row["delta_calls"]) == (ca, cb, cb - ca), cat
        assert row["delta_pct"] == pytest.approx(100 * (tb - ta) / ta) if ta else pd.isna(row["delta_pct"]), cat
        assert row["call"] == stats.NO_REPEATS
    assert got.loc["moe_experts", "class"] == "gemm" and got.loc["allreduce", "class"] == "communication"
    steps = compare.step_differences({s.letter: compare.profile_summaries(s)[None] for s in sources})
    wall = steps.set_index("figure").loc["wall-clock step"]
    assert (wall["median_a"], wall["median_b"], wall["delta"]) == (1000, 800, -200)


def test_serving_and_micro_benchmark_differences_without_repeats_are_marked_no_repeats(two_runs):
    sources = compare.load_sources(two_runs)
    levels = {s.letter: compare.serving_levels(s)[0] for s in sources}
    d = compare.serving_differences(levels).set_index(["level", "metric"])
    assert d.loc[(1, "tpot_p50_us"), "median_a"] == pytest.approx(4000)
    assert d.loc[(1, "tpot_p50_us"), "delta"] == pytest.approx(-1000)
    assert d.loc[(1, "tpot_p50_us"), "delta_pct"] == pytest.approx(-25)
    assert set(d["call"]) == {stats.NO_REPEATS}
    gemm = compare.pair_differences({s.letter: compare.gemm_frame(compare._read_table(s, "gemm.parquet")[0])
                                     for s in sources}, ["op", "dtype", "l2", "batch"], "time_us")
    assert len(gemm) == 6 and np.allclose(gemm["delta_pct"], -50.0) and set(gemm["call"]) == {stats.NO_REPEATS}
    coll = compare.pair_differences({s.letter: compare.collectives_frame(
        compare._read_table(s, "collectives.parquet")[0]) for s in sources}, ["what", "size"], "time_us")
    assert list(coll["size"]) == [1024, 4096, 16384] and np.allclose(coll["delta_pct"], 100.0)   # rank 0 only
    assert set(coll["what"]) == {"sweep all_reduce torch_gloo back_to_back in-place"}
    html = compare.write_compare(sources).read_text()
    assert stats.NO_REPEATS in html and stats.SIGNIFICANT + "</td>" not in html


def test_repeats_that_differ_are_significant_and_repeats_that_overlap_are_noise(tmp_path):
    out = tmp_path / "outputs"
    # level 1: B faster in every repeat (no overlap); level 2: the same spread in both
    a = make_run(out, "20260101T000000Z-a", tpots={1: [4000, 4100, 3950, 4050], 2: [5000, 5300, 4900, 5100]},
                 repeats=True)
    b = make_run(out, "20260102T000000Z-b", tpots={1: [3000, 3080, 2990, 3020], 2: [5050, 4950, 5250, 5000]},
                 repeats=True)
    levels = pd.read_parquet(a / "data" / "serving_levels_repeats.parquet")
    assert list(levels[["level", "repeat"]].itertuples(index=False, name=None)) == [
        (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2), (2, 3)]   # one row per (level, repeat)
    sources = compare.load_sources([a, b])
    d = compare.serving_differences({s.letter: compare.serving_levels(s)[0] for s in sources}).set_index(
        ["level", "metric"])
    assert d.loc[(1, "tpot_p50_us"), "call"] == stats.SIGNIFICANT
    assert d.loc[(1, "tpot_p50_us"), "n_a"] == 4 and d.loc[(1, "tpot_p50_us"), "high"] < 0
    assert d.loc[(1, "tpot_p50_us"), "median_a"] == pytest.approx(np.median([4000, 4100, 3950, 4050]))
    assert d.loc[(2, "tpot_p50_us"), "call"] == stats.WITHIN_NOISE
    bands = compare.serving_bands({s.letter: compare.serving_levels(s)[0] for s in sources})
    one = bands[(bands["run"] == "A") & (bands["level"] == 1) & (bands["metric"] == "tpot_p50_us")].iloc[0]
    assert one["n"] == 4 and 3950 <= one["low"] <= one["median"] <= one["high"] <= 4100
    html = compare.write_compare(sources).read_text()
    assert ">significant<" in html and ">within noise<" in html and "95% band" in html
    from decodescope.report.index import headline

    assert headline(a).tpot_p50_us == pytest.approx(np.median([4000, 4100, 3950, 4050]))   # index: median of repeats


def test_a_phase_missing_in_one_run_is_named_in_the_page(tmp_path):
    out = tmp_path / "outputs"
    a = make_run(out, "20260101T000000Z-a", tpots={1: [4000]}, categories=CATS_A)
    b = make_run(out, "20260102T000000Z-b", gemm_scale=None, coll_scale=None,
                 statuses={"01_serving": "failed", "02_gemm": "skipped", "04_profile": "failed"})
    (b / "data" / "collectives.parquet").write_bytes(b"cut short")
    html = compare.build_compare([a, b]).read_text()
    assert "B: 20260102T000000Z-b has no data/serving_levels.parquet (01_serving: failed)." in html
    assert "B: 20260102T000000Z-b has no data/gemm.parquet (02_gemm: skipped)." in html
    assert "has an unreadable data/collectives.parquet" in html
    assert "B: 20260102T000000Z-b has no data/profile_summary.json (04_profile: failed)." in html
    assert "Fewer than two sources have a profile" in html


def test_variants_are_addressed_by_path_or_colon_with_their_own_params(tmp_path):
    out = tmp_path / "outputs"
    a = make_run(out, "20260101T000000Z-a", tpots={1: [4000]})
    vdata = a / "variants" / "nccl" / "data"
    vdata.mkdir(parents=True)
    write_serving(vdata, {1: [3500]}, repeats=False)
    params = yaml.safe_load((a / "params.yaml").read_text())
    params["server"]["engine_args"]["note"] = "variant"
    (a / "variants" / "nccl" / "params.yaml").write_text(yaml.safe_dump(params))
    raw = json.loads((a / "manifest.json").read_text())
    raw["variants"] = {"nccl": {"status": "ok", "params": {"name": "nccl", "profile": False}}}
    write_record(a / "manifest.json", RunManifest.model_validate(raw))   # as the runner records a variant
    by_colon, by_path = compare.resolve(f"{a}:nccl", "B"), compare.resolve(str(a / "variants" / "nccl"), "B")
    assert by_colon.data_dir == by_path.data_dir == vdata.resolve() and by_colon.label == f"{a.name}:nccl"
    sources = compare.load_sources([str(a), f"{a}:nccl"])
    assert compare.params_diff(sources).set_index("key").loc["server.engine_args.note", "B"] == "variant"
    d = compare.serving_differences({s.letter: compare.serving_levels(s)[0] for s in sources})
    assert d.set_index(["level", "metric"]).loc[(1, "tpot_p50_us"), "delta"] == pytest.approx(-500)
    assert compare.default_out(sources).name == f"{a.name}-vs-{a.name}_nccl.html"
    phases = compare.phases_table(sources).set_index("phase")
    assert phases.loc["01_serving", "B"] == "variant ok" and phases.loc["04_profile", "B"] == "not run for a variant"
    html = compare.write_compare(sources).read_text()
    assert f"B: {a.name}:nccl has no variants/nccl/data/gemm.parquet (02_gemm: not run for a variant)." in html


@pytest.mark.parametrize("bad, named", [
    ("nowhere", "nowhere: no such directory"),
    ("not-a-run", "not-a-run: not a run directory: it has no manifest.json"),
    ("RUN:missing", "variants/missing: no such variant of this run; its variants: none"),
    ("RUN/variants/missing", "variants/missing: no such variant"),
    ("RUN/params.yaml", "params.yaml: not a directory"),
])
def test_a_path_that_is_not_a_run_exits_2_naming_it(tmp_path, capsys, bad, named):
    run = make_run(tmp_path, "20260101T000000Z-a", tpots={1: [4000]})
    (tmp_path / "not-a-run" / "data").mkdir(parents=True)
    arg = str(tmp_path / bad.replace("RUN", run.name))
    assert main(["compare", str(run), arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and str(tmp_path) in err
    assert not (tmp_path / "compare").exists()


def test_one_run_alone_is_refused_and_the_cli_prints_the_page(tmp_path, capsys):
    run = make_run(tmp_path / "outputs", "20260101T000000Z-a", tpots={1: [4000]})
    assert main(["compare", str(run)]) == 2
    assert "at least two runs" in capsys.readouterr().err
    target = tmp_path / "elsewhere" / "cmp.html"
    assert main(["compare", str(run), str(run), "--out", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target) and target.is_file()
    assert not list(target.parent.glob(".cmp.html.*"))   # written atomically: no temporary left


def test_hostile_strings_are_escaped(two_runs):
    a, b = two_runs
    html = compare.build_compare([a, b]).read_text()
    assert HOSTILE not in html and "window.__ds_pwned" in html
    assert "&lt;script&gt;window.__ds_pwned='params'&lt;/script&gt;" in html   # in a table cell


@pytest.mark.integration  # headless Chromium: make test, not test-fast
def test_the_page_in_a_browser_draws_every_plot_and_loads_nothing(two_runs):
    from tests.browser import inspect_report

    seen = inspect_report(compare.build_compare(list(two_runs)))
    assert seen["console_errors"] == [] and seen["page_errors"] == [] and seen["network_requests"] == []
    assert seen["dialogs"] == [] and seen["pwned"] is None
    assert len(seen["figures"]) == 6 and all(n >= 1 for n in seen["figures"])
    assert HOSTILE in seen["text"]   # shown as text


# ---- the notebook ----------------------------------------------------------------------------------
def test_06_compare_is_a_notebook_but_not_a_phase(repo, tmp_path):
    import nbformat

    from decodescope.orchestration import phasenotebooks

    nb = nbformat.read(repo / "notebooks" / "06_compare.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert "runs = []" in params[0].source and 'out = ""' in params[0].source
    assert "06_compare" not in phasenotebooks.available_phases()
    assert (phasenotebooks.NOTEBOOK_DIR / "06_compare.ipynb").is_file()   # shipped with the others
    p = load_params(repo / "params" / "default.yaml")
    assert "06_compare" not in phasenotebooks.select_phases(p, None)
    with pytest.raises(RunError, match="06_compare"):
        phasenotebooks.select_phases(p, ["06_compare"])


def test_the_notebook_runs_with_papermill(two_runs, tmp_path):
    import papermill as pm

    a, b = two_runs
    out = tmp_path / "nb.html"
    pm.execute_notebook(str(REPO / "notebooks" / "06_compare.ipynb"), str(tmp_path / "06.ipynb"),
                        parameters={"runs": [str(a), str(b)], "out": str(out)}, kernel_name="python3",
                        progress_bar=False, cwd=str(REPO / "notebooks"))
    assert out.is_file()
    import nbformat

    executed = nbformat.read(tmp_path / "06.ipynb", as_version=4)
    figures = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs
               if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 6
