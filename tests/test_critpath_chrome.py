"""The critical path as a Chrome-format trace (critpath/chrome.py), from the traces of real runs (the
committed vLLM CPU TP=2 engine traces and a two-H200 step replay): written by `analyze-trace --critical-path`,
read back by decodescope's own reader and by HolisticTraceAnalysis, every path piece present on its rank's
track, each step's pieces summing to its wall time, each collective split into arrival skew and transfer with
the late rank named, and the slices on the rank traces' own clock."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from decodescope.cli.main import main
from decodescope.critpath.chrome import (CHROME_TRACE, CP_PID, PATH_KINDS, collectives_tid, path_tid,
                                               read_chrome_trace)
from decodescope.trace.load import load_trace_dir

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "traces"
REAL = ["vllm_cpu_tp2_c4", "h200x2_step_replay_graph"]


@pytest.fixture(scope="module", params=REAL)
def exported(request, tmp_path_factory):
    """analyze-trace --critical-path on a real run's traces: (trace dir, out dir, segments, trace read back)."""
    traces = FIXTURES / request.param
    out = tmp_path_factory.mktemp(request.param)
    assert main(["analyze-trace", str(traces), "--critical-path", "--out", str(out), "--workers", "1"]) == 0
    return traces, out, pd.read_parquet(out / "critical_path.parquet"), read_chrome_trace(out / CHROME_TRACE)


def _path(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["ph"] == "X") & df["cat"].isin(PATH_KINDS)]


def _steps(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["ph"] == "X") & (df["cat"] == "step")]


def test_every_path_piece_is_a_slice_on_its_ranks_track(exported):
    _, _, seg, df = exported
    path = _path(df)
    assert len(path) == len(seg) > 0
    want = seg.assign(tid=[path_tid(int(r)) for r in seg["rank"]], segment=seg["segment"].astype(str))
    got = path.assign(segment=path["cat"])
    key = ["step", "tid", "segment", "start_us", "dur_us"]
    a = want[key].sort_values(key).to_numpy()
    b = got.rename(columns={"ts_us": "start_us"})[key].sort_values(key).to_numpy()
    assert (a[:, :3] == b[:, :3]).all() and np.allclose(a[:, 3:].astype(float), b[:, 3:].astype(float), rtol=0,
                                                         atol=1e-6)
    assert (path["pid"] == CP_PID).all()
    names = {a.get("name") for a in df.loc[df["ph"] == "M", "args"]}
    assert {f"rank {r}: path" for r in seg["rank"].unique() if r >= 0} <= names


def test_each_steps_pieces_sum_to_its_wall_time(exported):
    _, _, _, df = exported
    walls = _steps(df).set_index("step")["dur_us"]
    sums = _path(df).groupby("step")["dur_us"].sum().reindex(walls.index, fill_value=0.0)
    assert len(walls) >= 3
    assert np.allclose(sums.to_numpy(), walls.to_numpy(), rtol=1e-9, atol=1e-6)
    starts = df[(df["ph"] == "i") & (df["cat"] == "step")]  # a boundary at each step's start
    assert np.allclose(np.sort(starts["ts_us"].to_numpy()), np.sort(_steps(df)["ts_us"].to_numpy()))


def test_the_slices_are_on_the_rank_traces_clock(exported):
    """Every op and transfer slice lies inside an event of the same name on its rank in the engine's own trace
    (as decodescope reads it: ts unshifted), so both load together in one timeline."""
    traces, _, _, df = exported
    ev = load_trace_dir(traces, workers=1).events
    ev = ev.assign(end_us=ev["ts_us"] + ev["dur_us"], name=ev["name"].astype(str))
    ops = _path(df)[_path(df)["cat"].isin(["op", "transfer"])]
    lane_rank = {path_tid(int(r)): int(r) for r in ev["rank"].unique()}
    missing = 0
    for (tid, name), g in ops.groupby(["tid", "name"]):
        e = ev[(ev["rank"] == lane_rank[tid]) & (ev["name"] == name)].sort_values("ts_us")
        ts, end = e["ts_us"].to_numpy(), e["end_us"].to_numpy()
        for s, d in zip(g["ts_us"], g["dur_us"]):
            at = np.searchsorted(ts, s + 1e-6, side="right")
            inside = (ts[:at] <= s + 1e-6) & (end[:at] >= s + d - 1e-6)
            missing += not inside.any()
    assert len(ops) > 100 and missing == 0


def test_collectives_are_split_into_arrival_skew_and_transfer_naming_the_late_rank(exported):
    _, _, _, df = exported
    coll = df[(df["ph"] == "X") & (df["cat"] == "collective")]
    args = pd.DataFrame(list(coll["args"]), index=coll.index)
    coll = coll.assign(instance=args["instance"], late_rank=args["late_rank"], skew=args["arrival_skew_us"],
                       rank=(coll["tid"] - 101) // 2)
    assert (coll["tid"] == [collectives_tid(r) for r in coll["rank"]]).all()
    skew = coll[coll["name"].str.startswith("arrival skew")]
    transfer = coll[coll["name"].str.startswith("transfer")]
    assert len(skew) > 0 and len(transfer) > 0
    assert (skew["late_rank"] != skew["rank"]).all()  # the late rank does not wait for itself
    assert np.allclose(skew["dur_us"], skew["skew"])
    assert (skew["name"] == [f"arrival skew: {a['collective']} (waits for rank {a['late_rank']})"
                             for a in skew["args"]]).all()
    # the late rank's own transfer starts where the waiting ranks' skew ends: at its entry
    for inst, g in coll.groupby("instance"):
        lr = int(g["late_rank"].iloc[0])
        late = g[(g["rank"] == lr) & g["name"].str.startswith("transfer")]
        for _, s in g[g["name"].str.startswith("arrival skew")].iterrows():
            if len(late):
                assert s["ts_us"] + s["dur_us"] == pytest.approx(late["ts_us"].iloc[0], abs=1e-6)
    on_path = _path(df)[_path(df)["cat"] == "transfer"]
    assert len(on_path) and all({"instance", "late_rank", "arrival_skew_us"} <= set(a) for a in on_path["args"])
    assert set(a["instance"] for a in on_path["args"]) <= set(coll["instance"])


def test_holistic_trace_analysis_reads_every_piece_and_the_step_sums(exported, tmp_path, monkeypatch):
    """HTA's own parser (hta.common.trace.Trace): the same slices per kind, each step's path pieces summing to
    its wall time. HTA rounds timestamps to whole microseconds unless HTA_DISABLE_NS_ROUNDING is set, and keeps
    durations as float32: the sums agree to float32's precision over the step's pieces."""
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    from hta.common.trace import Trace
    from hta.configs.default_values import AttributeSpec, ValueType, YamlVersion
    from hta.configs.parser_config import ParserConfig

    _, out, _, df = exported
    v = YamlVersion(1, 0, 0)
    cfg = ParserConfig(ParserConfig.get_default_args() + [AttributeSpec("step", "step", ValueType.Int, -1, v),
                                                          AttributeSpec("late_rank", "late_rank", ValueType.Int, -1, v)])
    t = Trace(trace_files={0: str(out / CHROME_TRACE)}, trace_dir=str(out), parser_config=cfg)
    t.load_traces()
    h = t.get_trace(0)
    sym = t.symbol_table.sym_table
    h = h.assign(cat_s=[sym[i] for i in h["cat"]])
    mine = df[df["ph"] == "X"]["cat"].value_counts().sort_index()
    assert h["cat_s"].value_counts().sort_index().to_dict() == mine.to_dict()
    walls = h[h["cat_s"] == "step"].set_index("step")["dur"].astype(float)
    path = h[h["cat_s"].isin(PATH_KINDS)]
    sums = path.groupby("step")["dur"].apply(lambda d: float(np.sum(d.astype(float)))).reindex(walls.index)
    n = path.groupby("step").size().reindex(walls.index).to_numpy()
    tol = (n + 1) * walls.to_numpy() * np.finfo(np.float32).eps
    assert len(walls) >= 3 and (np.abs(sums.to_numpy() - walls.to_numpy()) <= tol).all()
    transfers = h[h["cat_s"] == "transfer"]
    assert len(transfers) and (transfers["late_rank"] >= 0).all()
