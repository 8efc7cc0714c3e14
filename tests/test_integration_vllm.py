"""Against the real vLLM CPU server of the embedded default (tiny Qwen3-MoE, dummy weights, TP=2)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from decodescope.schema.params import load_params
from decodescope.schema.records_probe import read_probe_output
from decodescope.exec.runserver import start_for_params
from decodescope.exec.server import ServerError, port_is_free
from tests.browser import inspect_report
from tests.test_logging import progress_lines_in

pytestmark = pytest.mark.integration
DECODESCOPE = [sys.executable, "-m", "decodescope.cli.main"]


def _params(repo, tmp_path, port, extra_engine_args=None, name="it", source="default"):
    """params/<source>.yaml into tmp_path as <name>.yaml: its output, model config path, port and run name set."""
    text = (repo / f"params/{source}.yaml").read_text()
    text = text.replace("output_dir: outputs", f"output_dir: {tmp_path / 'out'}")
    text = text.replace("config: models/", f"config: {repo / 'params/models'}/")
    text = text.replace("port: 8765", f"port: {port}")
    text = text.replace(f"name: {source}", f"name: {name}")
    if extra_engine_args:
        for k, v in extra_engine_args.items():
            text = text.replace("    load-format: dummy", f"    load-format: dummy\n    {k}: {v}")
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    return p


def sweep_to_1mib(text: str) -> str:
    """The collective sweep to 1 MiB instead of the params' 16 MiB: what the tests read of 03 is at the step's
    sizes (0.5-4 KiB); the 2-16 MiB sizes are about half of 03's time on two cores."""
    assert text.count("  warmup: 3\n") == 1
    return text.replace("  warmup: 3\n", "  warmup: 3\n  sweep_max_bytes: 1048576\n")


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_server_that_exits_during_startup_fails_fast_with_its_log(repo, tmp_path):
    params = load_params(_params(repo, tmp_path, 8791, {"kv-cache-dtype": "no-such-dtype"}))
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        start_for_params(params, tmp_path / "run").stop()
    elapsed = time.monotonic() - t0
    assert elapsed < 120 < params.server.startup_timeout_s
    assert "exited with code" in str(e.value)
    assert "no-such-dtype" in str(e.value).split("last lines", 1)[1]  # the log tail is quoted
    assert port_is_free("127.0.0.1", 8791)


# Distinct secrets planted in every input channel of the e2e run: params (server.api_key), server.env
# (HF_TOKEN and a password-like key), and the environment decodescope runs in.
SECRETS = {"api_key": "sk-e2e-apikey-1f2e3d4c", "server_env_token": "hf_e2e_serverenv_9a8b7c",
           "server_env_password": "pw-e2e-serverenv-5d6e", "environment": "sk-e2e-environ-0a1b2c"}
# markup planted in a params value that reaches the report (the served model name)
HOSTILE_MODEL = "tiny-moe<img src=x onerror=\"window.__ds_pwned='model';alert(1)\">"


def _plant(path: Path) -> None:
    text = path.read_text()
    text = text.replace("  startup_timeout_s: 600", f"  startup_timeout_s: 600\n  api_key: {SECRETS['api_key']}")
    text = text.replace('    VLLM_CPU_KVCACHE_SPACE: "1"', '    VLLM_CPU_KVCACHE_SPACE: "1"\n'
                        f'    HF_TOKEN: {SECRETS["server_env_token"]}\n'
                        f'    MY_SERVICE_PASSWORD: {SECRETS["server_env_password"]}')
    text = text.replace("  name: tiny-qwen3-moe", f"  name: {json.dumps(HOSTILE_MODEL)}")
    path.write_text(text)


@pytest.fixture
def e2e(e2e_run):
    """The session's one end-to-end run (tests/conftest.py e2e_run: run_e2e below), which
    test_experiments_vllm reads as the experiments campaign and test_integration_ssh sets its run over ssh
    against."""
    return e2e_run


E2E_PORT = 8792
# the variants measured once each, the baseline's levels three times (their bands): on an AVX2 host (gloo,
# ~30 ms a token) the variants' two further repeats were ~3 of the campaign's 17 minutes; a TP=1 start's
# repeats agreed within 10% where its starts differed by up to 40%
ONCE = ("tp1", "spec-ngram")
E2E_REPEATS = 3


def e2e_params(repo: Path, tmp: Path) -> Path:
    """params/experiments.yaml (the embedded default with its fixes as variants) into tmp, with secrets and
    markup planted (_plant), the collective sweep to 1 MiB, and each variant measured once."""
    params = _params(repo, tmp, E2E_PORT, name="e2e", source="experiments")
    text = sweep_to_1mib(params.read_text())  # the 2-16 MiB sizes were most of 03's 71 s on an AVX2 host
    # the un-graphed capture, asked for: the CPU engine runs no CUDA graphs, so 04 takes it only when asked
    assert text.count("\nprofile:\n") == 1
    text = text.replace("\nprofile:\n", "\nprofile:\n  host_ops_tokens: 256\n")
    for name in ONCE:
        assert text.count(f"  - name: {name}\n") == 1
        text = text.replace(f"  - name: {name}\n", f"  - name: {name}\n    workload: {{repeats: 1}}\n")
    params.write_text(text)
    _plant(params)
    return params


def run_e2e(repo: Path, tmp: Path) -> dict:
    """One real `decodescope run` of every phase on the embedded default with its fixes as variants and the
    baseline's levels repeated (the experiments campaign, which test_experiments_vllm reads): one run where
    make test's lone stage had two that measured the same baseline (~120 s of its ~560 s). Secrets and markup
    are planted in its inputs; the process list is sampled while it runs."""
    params = e2e_params(repo, tmp)
    env = dict(os.environ, OPENAI_API_KEY=SECRETS["environment"])
    t0 = time.monotonic()
    out, err = tmp / "stdout", tmp / "stderr"
    argvs: set[str] = set()
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(DECODESCOPE + ["run", str(params), "--repeats", str(E2E_REPEATS)], stdout=o,
                                stderr=e, text=True, cwd=repo, env=env)
        while proc.poll() is None and time.monotonic() - t0 < 2400:
            for p in psutil.process_iter(["cmdline"]):
                argvs.add(" ".join(p.info["cmdline"] or []))
            time.sleep(0.5)
        proc.wait(timeout=60)
    wall = time.monotonic() - t0
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())
    report = Path(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else None
    run_dir = report.parent if report else None
    return {"proc": result, "report": report, "run_dir": run_dir, "wall_s": wall,
            "params": load_params(params), "argvs": argvs,
            "manifest": json.loads((run_dir / "manifest.json").read_text()) if run_dir else {},
            "verdict": json.loads((run_dir / "data/verdict.json").read_text()) if run_dir else {}}


def test_run_ends_with_the_report_path_and_every_phase_ok(e2e):
    proc = e2e["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert e2e["report"].name == "report.html" and e2e["report"].is_file()
    manifest = e2e["manifest"]
    assert {p: v["status"] for p, v in manifest["phases"].items()} == {
        "00_host": "ok", "01_serving": "ok", "02_gemm": "ok", "03_collectives": "ok", "04_profile": "ok",
        "05_verdict": "ok"}
    assert "[1/6] 00_host" in proc.stderr and "[6/6] 05_verdict" in proc.stderr
    # the micro-benchmarks before the server phases: one server start serves 01 and 04
    assert "[2/6] 02_gemm" in proc.stderr and "[4/6] 01_serving" in proc.stderr and "[5/6] 04_profile" in proc.stderr
    order = sorted(manifest["phases"], key=lambda p: manifest["phases"][p]["start"])
    assert order == ["00_host", "02_gemm", "03_collectives", "01_serving", "04_profile", "05_verdict"]
    for name in ("host.json", "serving_levels.parquet", "gemm.parquet", "collectives.parquet", "kernels.parquet",
                 "profile_summary.json", "verdict.json"):
        assert (e2e["run_dir"] / "data" / name).is_file(), name
    print(f"the campaign's wall time {e2e['wall_s']:.1f} s, the baseline's server start "
          f"{manifest['servers'][0]['start_s']:.1f} s, report {e2e['report'].stat().st_size / 1e6:.2f} MB")


def test_no_vllm_process_survives_the_run(e2e):
    manifest = e2e["manifest"]
    # the micro-benchmarks ran before it: one server for the baseline's sweep and profile, then the variants'
    first_variant = min(v["start"] for v in manifest["variants"].values())
    baseline = [s for s in manifest["servers"] if s["started"] < first_variant]
    assert len(baseline) == 1
    assert len(baseline[0]["pids"]) >= 4  # API server, engine core, TP workers
    pids = [p for s in manifest["servers"] for p in s["pids"]]
    assert _alive(pids) == []
    assert port_is_free("127.0.0.1", E2E_PORT)


def test_every_request_is_consistent(e2e):
    req = pd.read_parquet(e2e["run_dir"] / "data/serving_requests.parquet")
    measured = req[~req["warmup"]]
    max_tokens = e2e["params"].workload.output_tokens
    assert measured["ok"].all(), measured.loc[~measured["ok"], "error_text"].tolist()
    assert (measured["n_out"] == max_tokens).all()
    assert (measured["n_in_usage"] == e2e["params"].workload.input_tokens).all()
    recon = measured["ttft_us"] + measured["tpot_us"] * (measured["n_out"] - 1)
    assert ((recon - measured["e2e_us"]).abs() <= 0.01 * measured["e2e_us"]).all()
    # every token arrived in its own chunk (no output held back by the server)
    assert (measured["n_out_chunks"] >= 0.9 * measured["n_out"]).all()


def _vllm_metrics(measured: pd.DataFrame, duration_s: float, slo: dict):
    """vLLM's own `vllm bench serve` metric code run on our request records."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    outputs = [RequestFuncOutput(success=bool(r.ok), latency=r.e2e_us / 1e6, ttft=r.ttft_us / 1e6,
                                 itl=[x / 1e6 for x in r.itl_us], output_tokens=int(r.n_out),
                                 prompt_len=int(r.n_in_usage), start_time=r.send_ns / 1e9)
               for r in measured.itertuples()]
    metrics, _ = calculate_metrics([], outputs, duration_s, None, [50.0, 90.0, 99.0],
                                   {"ttft": slo["ttft_ms"], "tpot": slo["tpot_ms"]})
    return metrics


def test_level_metrics_equal_vllm_bench_serves_definitions_on_the_same_records(e2e):
    """TTFT/TPOT/ITL/E2E, throughputs and goodput of every level and repeat, recomputed from the same real
    requests by vLLM's own benchmark code: the definitions agree exactly, whatever the server's speed."""
    req = pd.read_parquet(e2e["run_dir"] / "data/serving_requests.parquet")
    rows = pd.read_parquet(e2e["run_dir"] / "data/serving_levels_repeats.parquet")
    assert len(rows) == 3 * E2E_REPEATS
    slo = e2e["params"].workload.slo.model_dump()
    for ours in rows.to_dict("records"):
        measured = req[(req["level"] == ours["level"]) & (req["repeat"] == ours["repeat"]) & ~req["warmup"]]
        m = _vllm_metrics(measured, ours["duration_s"], slo)
        pct = lambda pairs, q: dict(pairs)[q] * 1e3  # noqa: E731  (ms -> us)
        expected = {
            "ttft_mean_us": m.mean_ttft_ms * 1e3, "ttft_p50_us": m.median_ttft_ms * 1e3,
            "ttft_p99_us": pct(m.percentiles_ttft_ms, 99.0), "tpot_mean_us": m.mean_tpot_ms * 1e3,
            "tpot_p50_us": m.median_tpot_ms * 1e3, "tpot_p90_us": pct(m.percentiles_tpot_ms, 90.0),
            "itl_mean_us": m.mean_itl_ms * 1e3, "itl_p50_us": m.median_itl_ms * 1e3,
            "itl_p99_us": pct(m.percentiles_itl_ms, 99.0), "e2e_p50_us": m.median_e2el_ms * 1e3,
            "output_throughput_tok_s": m.output_throughput, "request_throughput_rps": m.request_throughput,
            "goodput_rps": m.request_goodput, "ok": m.completed,
        }
        for col, want in expected.items():
            assert ours[col] == pytest.approx(want, rel=1e-9), f"level {ours['level']}, repeat {ours['repeat']}: {col}"


def test_levels_obey_littles_law(e2e):
    levels = pd.read_parquet(e2e["run_dir"] / "data/serving_levels_repeats.parquet")
    assert sorted(set(levels["level"])) == [1, 2, 4]
    assert (levels["failed"] == 0).all()
    rel = (levels["inflight_sampled_mean"] - levels["littles_lw"]).abs() / levels["littles_lw"]
    assert (rel <= 0.20).all(), levels[["level", "inflight_sampled_mean", "littles_lw"]]


def test_profile_finds_the_allreduces_the_architecture_expects(e2e):
    summary = json.loads((e2e["run_dir"] / "data/profile_summary.json").read_text())
    assert summary["device"] == "cpu" and summary["ranks"] == [0, 1]
    assert summary["steps"]["decode"] >= 10
    exp = [r for r in summary["expected_vs_observed"] if r["collective"] == "all_reduce"]
    assert len(exp) == 2
    for r in exp:
        assert r["expected_per_step"] == 1 + 2 * 4
        assert r["observed_per_step"] == r["expected_per_step"]
    for rank, share in summary["allreduce_share_of_time"].items():
        assert 0.0 < share < 1.0
    print("all-reduce share per rank:", summary["allreduce_share_of_time"])
    # every op of the real CPU TP=2 trace lands in a named category: `other` under 1% of op time per rank
    kernels = pd.read_parquet(e2e["run_dir"] / "data/kernels.parquet")
    other = kernels[kernels["category"].astype(str) == "other"].groupby("rank")["time_us"].sum()
    share = (other.reindex(kernels["rank"].unique(), fill_value=0.0) / kernels.groupby("rank")["time_us"].sum())
    print("share of op time in 'other' per rank:", share.round(4).to_dict())
    assert (share < 0.01).all(), share
    assert list((e2e["run_dir"] / "traces").rglob("*rank0*.pt.trace.json.gz"))
    assert list((e2e["run_dir"] / "traces").rglob("*profiler_out*"))


def test_the_verdict_answers_from_the_critical_path_and_its_collective_bound_moves_it(e2e):
    """On a real vLLM CPU TP=2 run (shm or gloo, as the host's vLLM takes it): the headline names what holds the
    critical path of a decode step, read from 04's critical_path.json; the all-reduce's instances (9 a step:
    the embedding's and two per layer, gloo's wait ops counted with their async calls) are split into skew and
    transfer; and where the transfer holds a fifth of the wall step or more, freeing it moves the replayed step
    by at least a quarter of that share (the gloo path's largest part had no bound that moved it)."""
    v, run = e2e["verdict"], e2e["run_dir"]
    b = v["bottleneck"]
    assert b["basis"] == "critical path"
    rec = json.loads((run / "data" / "profile" / f"c{b['level']}" / "critical_path.json").read_text())
    top = max(rec["shares"], key=lambda r: r["path_share_median"])
    assert (b["category"], b["share"]) == (top["category"], top["path_share_median"])
    assert v["verdict"].startswith(b["category"]) and "of summed op time" in v["verdict"]
    assert "of the wall-clock decode step on its critical path" in e2e["report"].read_text()
    split = {r["category"]: r for r in rec["collective_split"]}
    ar = split["allreduce"]
    assert ar["instances_per_step"] == 1 + 2 * 4
    assert ar["skew_us_per_step"] >= 0 and ar["transfer_us_per_step"] > 0
    wall = rec["wall_us_median"]
    bound = next(x for x in rec["fix_bounds"] if x["category"] == "allreduce transfer")
    on_path = ar["transfer_on_path_us_per_step"] / wall
    print(f"{b['category']} {100 * b['share']:.0f}% of the wall step; allreduce transfer {100 * on_path:.0f}% and skew "
          f"{100 * ar['skew_on_path_us_per_step'] / wall:.0f}% on the path; freeing the transfer buys "
          f"{100 * bound['gain_share_median']:.0f}%")
    if on_path >= 0.2:
        assert bound["gain_share_median"] >= 0.25 * on_path
    assert "collective_wait" not in {x["category"] for x in rec["fix_bounds"]}


def test_the_ungraphed_capture_prices_the_custom_ops_of_a_real_engine(e2e):
    """Asked for (profile.host_ops_tokens: 256), 04 profiled one request of 256 prompt tokens on the real CPU
    engine into traces/host_ops/ (both ranks) and priced each outermost vllm:: op of its prefill step."""
    run = e2e["run_dir"]
    assert len(list((run / "traces" / "host_ops").glob("*rank*.pt.trace.json.gz"))) == 2
    ops = json.loads((run / "data" / "profile" / "host_ops.json").read_text())
    assert ops["prompt_tokens"] == 256 and ops["prefill_steps"] >= 1 and ops["decode_steps"] >= 2
    by = {o["name"]: o for o in ops["ops"]}
    assert by["vllm::unified_attention_with_output"]["calls_per_step"] == 4   # the tiny model's 4 layers
    assert all(o["host_us_per_call"] > 0 for o in ops["ops"])


def test_the_step_replay_runs_through_the_engines_communicator_and_is_priced_by_it(e2e, engine_allreduce):
    """00 records which all-reduce path the host's vLLM takes (vLLM CPU's shm all-reduce where it loads _C or
    _C_AVX512, gloo where it loads _C_AVX2); 03 replays the step through that communicator, and 05 prices it
    with 03's back-to-back timing of that same communicator."""
    host = json.loads((e2e["run_dir"] / "data/host.json").read_text())["engine_allreduce"]
    assert host["path"] == engine_allreduce.path and host["cpu_extension"] == engine_allreduce.cpu_extension
    engine = host["communicator"]
    assert engine == {"shm": "vllm_shm", "gloo": "torch_gloo"}[host["path"]]
    replay = pd.read_parquet(e2e["run_dir"] / "data/step_replay.parquet")
    assert set(replay["communicator"]) == {engine}
    rows = json.loads((e2e["run_dir"] / "data/verdict.json").read_text())["replay"]
    assert {r["batch"] for r in rows} == set(e2e["params"].microbench.batches)
    assert {r["communicator"] for r in rows} == {engine}
    print("step replay vs model:", [(r["batch"], round(r["replay_us"]), round(r["predicted_us"]), round(r["error"], 3))
                                    for r in rows])


def test_no_planted_secret_reaches_a_file_a_log_or_the_process_list(e2e):
    import gzip

    assert any("vllm.entrypoints.openai.api_server" in a for a in e2e["argvs"]), "the server was never seen"
    leaks = []
    for arg in e2e["argvs"]:
        leaks += [(k, "process list") for k, v in SECRETS.items() if v in arg]
    for path in [p for p in e2e["run_dir"].rglob("*") if p.is_file()]:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
        leaks += [(k, str(path)) for k, v in SECRETS.items() if v.encode() in data]
    for stream in ("stdout", "stderr"):
        leaks += [(k, stream) for k, v in SECRETS.items() if v in getattr(e2e["proc"], stream)]
    assert leaks == []
    from tests.faultload import record_fault

    n_files = sum(1 for p in e2e["run_dir"].rglob("*") if p.is_file())
    record_fault("secrets planted in params (api key), server.env (token, password) and the environment",
                 "none reaches a file of the run, its stdout/stderr or any process's command line (the api key "
                 "goes to vLLM as VLLM_API_KEY)", rc=e2e["proc"].returncode,
                 results_lost=f"none; {len(SECRETS)} secrets x {n_files} files, 2 streams, "
                              f"{len(e2e['argvs'])} command lines sampled: 0 leaks", processes_left=0, shm_files_left=0)


def test_report_draws_every_figure_offline(e2e):
    seen = inspect_report(e2e["report"])
    assert seen["dialogs"] == [] and seen["pwned"] is None  # the planted model name stayed text
    assert "onerror=" in seen["text"]
    assert len(seen["figures"]) >= 10
    assert all(n >= 1 for n in seen["figures"]), seen["figures"]
    assert seen["console_errors"] == [] and seen["page_errors"] == []
    assert seen["network_requests"] == []
    assert seen["statuses"].count("ok") >= 6
    # the verdict is the front page: it comes right after the header
    text = seen["text"]
    assert text.index("05_verdict · Verdict") < text.index("00_host · Host inventory")


def test_no_progress_line_reaches_the_report_or_an_executed_notebook(e2e):
    """Progress is logged to logs/decodescope.log, not into a cell's output (tests/test_logging.py)."""
    assert progress_lines_in(e2e["report"].read_text()) == []
    for nb in sorted((e2e["run_dir"] / "notebooks").glob("*.ipynb")):
        assert progress_lines_in(nb.read_text()) == [], nb.name
    kept = (e2e["run_dir"] / "logs" / "decodescope.log").read_text()
    assert "decodescope.profiling.capturephase: profile: concurrency" in kept
    assert "decodescope.serving.sweep: serving sweep: level" in kept


# Ctrl-C once the server is up, with SIGINT ignored as a background job starts: covered by
# test_faults.py::test_ctrl_c_in_every_phase_keeps_what_finished_and_leaves_nothing_running, whose runs
# start so and are interrupted in each phase, the serving and profile phases with their server up.


ROUNDS = 3
# a round is compared when most tokens reached both clients one step at a time (on this host 10-55% of
# gaps are coalesced in about half the rounds: a client or the API server was off-CPU for a while)
SIDE_BY_SIDE_COALESCED_MAX = 0.20
N_SIDE_BY_SIDE = 16  # ours
# vllm bench sends six times as many, so it is still sending when ours ends: ours' run_sweep starts its
# telemetry process and builds its prompts through the server (~3 s beside vllm bench's requests) before its
# first request, and vllm bench's 32 requests (twice ours, as before) were often all done by then (2.6 s here:
# up to 6 of a test's 3 to 14 rounds had no request side by side)
N_BENCH = 6 * N_SIDE_BY_SIDE
# vllm bench's output lengths vary around ours (32 tokens, +-10%: 29 to 35, median 32), so the two streams do not
# stay in step. With every request 32 tokens long the two clients' requests ended at the same step and started
# again together, round after round: whichever prompt the server took second waited a prefill step in its TTFT,
# which the other client's TPOT paid instead, so a round's TPOT split one way (a forced-AVX2 suite read rounds of
# 0.90, 1.11 and 1.12, with E2E within 5%). With lengths drawn around 32 each client's prompts land at every point
# of the other's decodes; their E2E is compared restated at 32 tokens.
BENCH_OUTPUT_RANGE = 0.1
OURS_SIDE = """
import os, re, sys, time, urllib.request
os.sched_setaffinity(0, {1})
from decodescope.serving.sweep import SweepConfig, run_sweep, sweep_prompts
base_url, model, out, n, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
cfg = SweepConfig(base_url=base_url, model=model, endpoint="completions", levels=[1], input_tokens=64,
                  output_tokens=32, requests_per_level=n, warmup_requests=0, timeout_s=300, seed=seed,
                  completions_prompt="text")
# the prompts are made while the server is idle: made after the signal below, their 32 calls to /tokenize
# and /detokenize waited behind vllm bench's stream; no request ran side by side in 17 of 36 rounds of one
# run, and in two rounds of another ours began 8.6 and 8.8 s after vllm bench's first request (its 96 took 8.0
# and 8.2 s)
prompts = sweep_prompts(cfg)
print("ready", flush=True)  # the test starts vllm bench once this process is waiting for it
deadline = time.monotonic() + 600
while time.monotonic() < deadline:  # start with vllm bench's first request (its start-up is slow)
    metrics = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    if any(float(v) >= 1 for v in re.findall(r"^vllm:num_requests_running{[^}]*} ([0-9.]+)", metrics, re.M)):
        break
    time.sleep(0.05)
req, _ = run_sweep(cfg, out + ".d", progress=False, prompts=prompts)
req[["send_ns", "end_ns", "ok", "ttft_us", "tpot_us", "e2e_us", "itl_us"]].to_parquet(out)
"""


# the fewest requests a side, with prefills apart, whose medians a round compares
MIN_APART = 5


def _prefill_overlaps(a: pd.DataFrame, b: pd.DataFrame) -> "pd.Series":
    """Per request of `a`: whether its wait for its first token (send to first token) overlaps one of `b`'s."""
    a0, a1 = a["send_ns"].to_numpy(), (a["send_ns"] + a["ttft_us"] * 1e3).to_numpy()
    b0, b1 = b["send_ns"].to_numpy(), (b["send_ns"] + b["ttft_us"] * 1e3).to_numpy()
    return pd.Series(((a0[:, None] < b1[None, :]) & (b0[None, :] < a1[:, None])).any(axis=1), index=a.index)


def _in_window(df: pd.DataFrame, start_ns: float, end_ns: float) -> pd.DataFrame:
    return df[(df["send_ns"] >= start_ns) & (df["end_ns"] <= end_ns)]


def test_our_tpot_matches_vllm_bench_serve_side_by_side_on_the_same_server(repo, tmp_path):
    """Both clients at once against one server, one request each in flight, so every decode step
    serves one request of each and a change of the server's speed hits both. Compared on the requests
    that both ran in the same time window, in rounds where both saw tokens one step at a time: TPOT and
    E2E medians, the median round within 10%. Ours sends the prompt as text, as vllm bench does: the API
    server's tokenizing of a text prompt sits in its TTFT and so out of its TPOT (with token ids ours read
    TTFT 7-16 ms lower and TPOT 12-14% higher in some rounds, E2E within 1%; a CI run failed on it). (That our level metrics follow vLLM's definitions exactly
    is checked on shared records above; accuracy against ground truth is benchmarks/loadgen_fidelity.py.)"""
    from decodescope.exec.modeldir import resolve_model_dir
    from decodescope.serving.bench_compare import run_vllm_bench_serve
    from tests.vllm_bench import load_vllm_bench_requests
    from decodescope.serving.metrics import coalesced_fraction

    # The clients are what is compared, so the server is made steady: tensor-parallel 1 on core 0 (at
    # TP=2 on this 2-core host vLLM's engine core spins on its workers, bursts output and starves the
    # clients, each differently) and both clients on core 1.
    path = _params(repo, tmp_path, 8794, name="bench")
    text = path.read_text().replace("tensor_parallel: 2", "tensor_parallel: 1")
    text = text.replace('VLLM_CPU_OMP_THREADS_BIND: "0|1"', 'VLLM_CPU_OMP_THREADS_BIND: "0"')
    path.write_text(text.replace("    distributed-executor-backend: mp\n", ""))
    params = load_params(path)
    assert params.server.tensor_parallel == 1 and "distributed-executor-backend" not in params.server.engine_args
    server = start_for_params(params, tmp_path / "run")
    ratios = {"tpot_us": [], "e2e_us": []}
    try:
        _, tokenizer = resolve_model_dir(params)
        # one untimed run first: the first run after start-up pays one-time costs
        run_vllm_bench_serve(server.base_url, params.model.name, tokenizer, 1, 64, 32, 4,
                             tmp_path / "vllm", "warmup.json", prefix=("taskset", "-c", "1"))
        # up to 12 rounds per one compared: a CI run once met 18 rounds in a row that were all coalesced
        # (28-70%) or did not overlap; a round takes ~7 s, and the loop ends at the third compared one
        for r in range(12 * ROUNDS):
            if len(ratios["tpot_us"]) == ROUNDS:
                break
            ours_path = tmp_path / f"ours{r}.parquet"
            ours_proc = subprocess.Popen([sys.executable, "-c", OURS_SIDE, server.base_url, params.model.name,
                                          str(ours_path), str(N_SIDE_BY_SIDE), str(100 + r)],
                                         stdout=subprocess.PIPE, text=True)
            # vllm bench starts once ours waits for its first request: started together, ours' imports on the
            # clients' one core once outlasted vllm bench's whole run, and ours then sat out its 600 s
            # deadline before sweeping alone (a round lost, ~10 minutes)
            while (line := ours_proc.stdout.readline()) and line.strip() != "ready":
                pass  # anything an import prints before it
            assert line.strip() == "ready", "our client ended before it was ready"
            try:
                path = run_vllm_bench_serve(server.base_url, params.model.name, tokenizer, 1, 64, 32,
                                            N_BENCH, tmp_path / "vllm", f"bench{r}.json",
                                            prefix=("taskset", "-c", "1"), output_range_ratio=BENCH_OUTPUT_RANGE)
            finally:
                assert ours_proc.wait(timeout=600) == 0
            theirs = load_vllm_bench_requests(path)
            # each of their requests' E2E restated at our 32 tokens from its own TTFT and TPOT (vLLM's
            # definition: E2E = TTFT + TPOT x (n - 1)), so a round's E2E medians compare like for like
            theirs = theirs.assign(e2e_us=theirs["e2e_us"] + (32 - theirs["n_out"]) * theirs["tpot_us"])
            ours = pd.read_parquet(ours_path)
            ours = ours[ours["ok"]]
            start = max(ours["send_ns"].min(), theirs["send_ns"].min())
            end = min(ours["end_ns"].max(), theirs["end_ns"].max())
            ours_w, theirs_w = _in_window(ours, start, end), _in_window(theirs, start, end)
            if min(len(ours_w), len(theirs_w)) < 10:
                # one client was held up (a 2 s stall of one stream while the other flowed has been seen):
                # too few requests ran side by side for this round to compare; run another
                print(f"round {r}: only {len(ours_w)} and {len(theirs_w)} requests side by side, not compared")
                continue
            coalesced = coalesced_fraction(ours_w["itl_us"]), coalesced_fraction(theirs_w["itl_us"])
            if max(coalesced) > SIDE_BY_SIDE_COALESCED_MAX:
                # a client (or the server) sat off-CPU while tokens queued, then read them at once: on 2
                # shared cores that happens now and then to either side; such a round times scheduling
                print(f"round {r}: coalesced gaps {coalesced[0]:.0%} (ours) and {coalesced[1]:.0%} (vllm bench), "
                      "not compared")
                continue
            # Where both clients' prompts wait for their first token together, the server takes them in turn
            # and the one sent second waits a prefill step more in its TTFT, which the other client's TPOT pays
            # instead. Ours resends faster than vllm bench, so ours went first: in one round 7 of 16 requests
            # overlapped so, vllm bench's TTFT read 46.5 ms overlapped and 34.0 ms apart (ours 32.9 and 30.5),
            # and a suite's rounds read TPOT ratios of 1.04, 1.14 and 1.12 with E2E within 6%. That is the
            # server's order, not either client's timing: the requests compared are those whose prefill
            # overlaps none of the other client's.
            ours_a, theirs_a = ours_w[~_prefill_overlaps(ours_w, theirs_w)], theirs_w[~_prefill_overlaps(theirs_w, ours_w)]
            if min(len(ours_a), len(theirs_a)) < MIN_APART:
                print(f"round {r}: only {len(ours_a)} and {len(theirs_a)} requests whose prefills overlap none of "
                      "the other's, not compared")
                continue
            line = [f"round {r}: {len(ours_w)} and {len(theirs_w)} requests side by side, {len(ours_a)} and "
                    f"{len(theirs_a)} with prefills apart; ttft_us p50 decodescope "
                    f"{ours_a['ttft_us'].median() / 1e3:.2f} ms, vllm bench {theirs_a['ttft_us'].median() / 1e3:.2f} ms"]
            for key in ratios:
                o, t = ours_a[key].median(), theirs_a[key].median()
                ratios[key].append(o / t)
                line.append(f"{key} p50 decodescope {o / 1e3:.3f} ms, vllm bench {t / 1e3:.3f} ms")
            print("; ".join(line))
    finally:
        server.stop()
    assert len(ratios["tpot_us"]) == ROUNDS, "too few rounds where both clients ran side by side"
    for key, rs in ratios.items():
        assert abs(sorted(rs)[ROUNDS // 2] - 1) <= 0.10, (key, rs)  # the median round


def test_the_run_checks_its_critical_path_against_a_known_skew(e2e, engine_allreduce):
    """03 replays the step with rank 1 late by each of microbench.skew_calibration_us (0 and 250 us) before every
    collective, through the engine's communicator, and reads each profile back through the critical path: at
    250 us the path names rank 1 late and attributes the delay rank 1 ran; 05's methods section says so. The
    replay and both settings ran as three jobs of one torchrun launch (one log), each with its own delay."""
    rec = json.loads((e2e["run_dir"] / "data" / "skew_calibration.json").read_text())
    logs = e2e["run_dir"] / "logs"
    assert (logs / "step_probe.log").is_file() and not list(logs.glob("skew_calibration*.log"))
    delays = {d: read_probe_output(e2e["run_dir"] / d / "step_rank1.json", "step").meta["skew_us"]
              for d in ("data/step_ranks", "traces/skew_calibration/d0", "traces/skew_calibration/d250")}
    assert delays == {"data/step_ranks": 0.0, "traces/skew_calibration/d0": 0.0,
                      "traces/skew_calibration/d250": 250.0}
    assert rec["ran"] and rec["world"] == 2
    assert [r["injected_us"] for r in rec["settings"]] == e2e["params"].microbench.skew_calibration_us == [0.0, 250.0]
    assert {r["communicator"] for r in rec["settings"]} == {engine_allreduce.communicator}
    late = rec["settings"][1]
    print("skew calibration:", [(r["injected_us"], round(r["delivered_us"], 1), round(r["skew_us_median"], 1),
                                 r["recovered"]) for r in rec["settings"]])
    assert late["late_rank_share"] >= 0.9 and late["delivered_us"] >= 250.0
    assert abs(late["skew_us_median"] - late["raw_abs_skew_us_median"]) < 5.0
    assert late["instances"] >= rec["steps"] * (1 + 2 * 4) - 2
    assert "Checked here against a known delay" in e2e["report"].read_text()
