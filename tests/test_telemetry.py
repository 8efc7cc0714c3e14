"""Server and GPU telemetry during the sweep: against a loopback server whose /metrics is rendered the way
vLLM renders its own (prometheus_client, vLLM's metric names and labels) and moves with the requests it
serves, and on a real vLLM 0.32 exposition (tests/fixtures/vllm_metrics, made by tests/make_vllm_metrics.py)."""
import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from decodescope.schema.records_serving import TELEMETRY_COLUMNS
from decodescope.serving import promtext as P, telemetry as T, telemetry_read as R
from decodescope.serving.sweep import SweepConfig, run_sweep, warmup_count
from tests.conftest import free_port

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_metrics"
TOKENS = 8
ITL_S = 0.01
KEY = "sk-telemetry-test-3f9c2a71"
LABELS = {"model_name": "m", "engine": "0"}


class VllmMetrics:
    """vLLM's metrics (the names, labels and kinds of vllm/v1/metrics/loggers.py) in a registry of their
    own, updated as the fake engine serves; `log` keeps every value observed, in order."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        names = list(LABELS)
        self.running = Gauge("vllm:num_requests_running", "running", names, registry=r).labels(**LABELS)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", names, registry=r).labels(**LABELS)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "kv", names, registry=r).labels(**LABELS)
        self.preemptions = Counter("vllm:num_preemptions", "preemptions", names, registry=r).labels(**LABELS)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "d", names, registry=r).labels(**LABELS)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "dt", names, registry=r).labels(**LABELS)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "a", names, registry=r).labels(**LABELS)
        buckets = (0.001, 0.005, 0.01, 0.02, 0.04, 0.1, 0.5, 1.0, 5.0)
        hist = lambda name: Histogram(name, name, names, buckets=buckets, registry=r).labels(**LABELS)  # noqa: E731
        self.ttft = hist("vllm:time_to_first_token_seconds")
        self.itl = hist("vllm:inter_token_latency_seconds")
        self.tpot = hist("vllm:request_time_per_output_token_seconds")
        self.e2e = hist("vllm:e2e_request_latency_seconds")
        self.log = {"ttft": [], "tpot": []}


STATE = web.AppKey("state", SimpleNamespace)


def _refused(request: web.Request) -> bool:
    key = request.app[STATE].api_key
    return bool(key) and request.headers.get("Authorization") != f"Bearer {key}"


async def completions(request: web.Request):
    if _refused(request):
        return web.Response(status=401, text="unauthorized")
    body = await request.json()
    m: VllmMetrics = request.app[STATE].metrics
    arrival = time.monotonic()
    m.running.inc()
    m.kv.set(0.1 * m.running._value.get())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    first = last = None
    for i in range(n):
        await asyncio.sleep(ITL_S)
        now = time.monotonic()
        if first is None:
            first = now
            m.ttft.observe(now - arrival)
            m.log["ttft"].append(now - arrival)
        else:
            m.itl.observe(now - last)
        last = now
        await resp.write(f'data: {json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]})}\n\n'.encode())
    # the engine records a finished request's stats before its last event goes out
    tpot = (last - first) / (n - 1)
    m.tpot.observe(tpot)
    m.log["tpot"].append(tpot)
    m.e2e.observe(time.monotonic() - arrival)
    m.preemptions.inc()
    m.drafts.inc(n)
    m.draft_tokens.inc(3 * n)
    m.accepted.inc(2 * n)
    m.running.dec()
    usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


async def metrics(request: web.Request):
    if _refused(request):
        return web.Response(status=401, text="unauthorized")
    state = request.app[STATE]
    state.metrics_requests += 1
    mode = state.metrics_mode
    if mode == "500":
        return web.Response(status=500, text="metrics exporter broke")
    if mode == "gone":
        return web.Response(status=404, text="Not Found")
    if mode == "hang":
        await asyncio.sleep(2)
    return web.Response(body=generate_latest(state.metrics.registry),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def tokenize(request):
    body = await request.json()
    return web.json_response({"tokens": [ord(c) % 200 + 10 for c in body["prompt"]][:64]})


async def detokenize(request):
    body = await request.json()
    return web.json_response({"prompt": " ".join(map(str, body["tokens"]))})


class VllmLikeServer:
    """A real aiohttp server in a thread: streams completions, keeps vLLM's metrics, serves /metrics."""

    def __init__(self, api_key=None):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.app = web.Application()
        self.state = SimpleNamespace(api_key=api_key, metrics=VllmMetrics(), metrics_mode="ok", metrics_requests=0)
        self.app[STATE] = self.state
        self.app.router.add_post("/v1/completions", completions)
        self.app.router.add_get("/metrics", metrics)
        self.app.router.add_post("/tokenize", tokenize)
        self.app.router.add_post("/detokenize", detokenize)
        # a handler still sleeping (a 'slow' or hung answer the client gave up on) is cancelled at once on
        # stop: aiohttp's default waits up to 60 s for it, ~4.6 s a test here
        self.runner = web.AppRunner(self.app, shutdown_timeout=0.2)
        ready = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()
        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(10)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics(self) -> VllmMetrics:
        return self.state.metrics

    def stop(self):
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@pytest.fixture
def server():
    s = VllmLikeServer()
    yield s
    s.stop()


def _cfg(url, levels=(1, 2), requests=4, warmup=1, interval_s=0.2, api_key=None):
    return SweepConfig(base_url=url, model="m", endpoint="completions", levels=list(levels), input_tokens=16,
                       output_tokens=TOKENS, requests_per_level=requests, warmup_requests=warmup, timeout_s=5,
                       api_key=api_key, telemetry_interval_s=interval_s)


def _mean(xs):
    return sum(xs) / len(xs)


def _hist_mean_from_rows(df: pd.DataFrame, base: str) -> float:
    """The histogram's mean between the measured-start sample and the level's last, straight from the rows."""
    srv = df[df["source"] == "server"]
    mark = df[(df["metric"] == "mark") & (df["labels"] == '{"mark":"measured_start"}')]["scrape"].iloc[0]
    a, b = srv[srv["scrape"] >= mark]["scrape"].min(), srv["scrape"].max()
    at = lambda name, s: srv[(srv["metric"] == name) & (srv["scrape"] == s)]["value"].sum()  # noqa: E731
    return (at(f"{base}_sum", b) - at(f"{base}_sum", a)) / (at(f"{base}_count", b) - at(f"{base}_count", a)) * 1e6


# ---- the sweep against a server that keeps vLLM's metrics -------------------------------------------
def test_sweep_writes_telemetry_per_level_and_the_engines_tpot_from_its_histogram(server, tmp_path):
    _, levels = run_sweep(_cfg(server.url), tmp_path, progress=False)
    for level in (1, 2):
        df = pd.read_parquet(R.level_path(tmp_path, level))
        assert list(df.columns) == TELEMETRY_COLUMNS and set(df["level"]) == {level}
        marks = set(df.loc[df["metric"] == "mark", "labels"])
        assert marks == {'{"mark":"level_start"}', '{"mark":"measured_start"}', '{"mark":"level_end"}'}
        assert {"vllm:num_requests_running", "vllm:time_to_first_token_seconds_sum",
                "vllm:num_preemptions_total"} <= set(df["metric"])
        assert not df["metric"].str.endswith(("_bucket", "_created")).any()
    lv = levels.set_index("level")
    tpots, ttfts = server.metrics.log["tpot"], server.metrics.log["ttft"]
    start = 0
    for level in (1, 2):
        # the server saw the level's warm-up (1 request, at least one per slot: 1 then 2) then 4 measured
        # requests, one level after the other
        start += warmup_count(1, level)
        measured = slice(start, start + 4)
        start += 4
        df = pd.read_parquet(R.level_path(tmp_path, level))
        assert lv.loc[level, "server_tpot_mean_us"] == pytest.approx(_mean(tpots[measured]) * 1e6, rel=1e-9)
        assert lv.loc[level, "server_tpot_mean_us"] == pytest.approx(
            _hist_mean_from_rows(df, "vllm:request_time_per_output_token_seconds"), rel=1e-9)
        assert lv.loc[level, "server_ttft_mean_us"] == pytest.approx(_mean(ttfts[measured]) * 1e6, rel=1e-9)
        assert lv.loc[level, "server_preemptions"] == 4            # one per measured request, none from warm-up
        assert lv.loc[level, "server_spec_acceptance_pct"] == pytest.approx(200 / 3)
        assert lv.loc[level, "server_spec_accept_len"] == pytest.approx(3.0)
        assert lv.loc[level, "telemetry_scrape_failures"] == 0 and lv.loc[level, "telemetry_scrapes"] >= 3
        assert lv.loc[level, "server_running_max"] <= level
    # the client's TPOT carries the stream on top of the engine's
    assert (lv["tpot_mean_us"] >= 0.5 * lv["server_tpot_mean_us"]).all()


def test_gauges_are_averaged_over_the_samples_taken_while_the_measured_requests_ran(server, tmp_path):
    # samples every 20 ms: at 0.1 s a level of ~0.35 s held ~3, and a loaded host could miss every one taken
    # with all 4 running
    cfg = _cfg(server.url, levels=[4], requests=16, warmup=0, interval_s=0.02)
    _, levels = run_sweep(cfg, tmp_path, progress=False)
    row = levels.iloc[0]
    assert row["server_running_max"] == 4
    assert 1 <= row["server_running_mean"] <= 4
    assert row["server_kv_usage_max_pct"] == pytest.approx(40.0)


@pytest.mark.parametrize("mode,error", [("500", "HTTP 500"), ("gone", "HTTP 404")])
def test_a_metrics_endpoint_that_fails_is_recorded_and_the_sweep_completes(server, tmp_path, mode, error):
    server.state.metrics_mode = mode
    _, levels = run_sweep(_cfg(server.url), tmp_path, progress=False)
    assert list(levels["ok"]) == [4, 4]                      # the requests were measured all the same
    assert (levels["telemetry_scrape_failures"] == levels["telemetry_scrapes"]).all()
    assert levels["server_tpot_mean_us"].isna().all()
    df = R.load_telemetry(tmp_path)
    assert R.failures(df)[0][1].startswith(error)


def test_a_server_that_vanishes_is_recorded_and_the_sweep_completes(server, tmp_path):
    run_sweep(_cfg(server.url, levels=[1]), tmp_path, progress=False)
    server.stop()
    _, levels = run_sweep(_cfg(server.url, levels=[1, 2]), tmp_path, progress=False)
    lv = levels.set_index("level")
    assert lv.loc[1, "telemetry_scrape_failures"] == 0       # measured before: kept as it was
    assert lv.loc[2, "failed"] == 4 and lv.loc[2, "telemetry_scrape_failures"] == lv.loc[2, "telemetry_scrapes"]
    errors = [e for lv_, e, _ in R.failures(R.load_telemetry(tmp_path)) if lv_ == 2]
    assert any("Connection refused" in e or "ConnectionRefused" in e for e in errors), errors


def test_a_metrics_endpoint_that_hangs_costs_at_most_the_scrape_timeout(server, tmp_path):
    server.state.metrics_mode = "hang"
    t0 = time.monotonic()
    with T.Telemetry(server.url, tmp_path, interval_s=0.2, scrape_timeout_s=0.3, settle_s=0.0) as tel:
        with tel.level(3):
            tel.mark()
    assert time.monotonic() - t0 < 10
    summary = R.level_telemetry(tmp_path, 3)
    assert summary["telemetry_scrapes"] >= 3 and summary["telemetry_scrape_failures"] == summary["telemetry_scrapes"]
    assert any("timed out" in e for _, e, _ in R.failures(R.load_level(tmp_path, 3)))


def test_the_api_key_is_sent_as_a_header_and_written_nowhere(tmp_path):
    server = VllmLikeServer(api_key=KEY)
    try:
        _, levels = run_sweep(_cfg(server.url, levels=[2], api_key=KEY), tmp_path / "with", progress=False)
        assert levels["telemetry_scrape_failures"].iloc[0] == 0 and levels["ok"].iloc[0] == 4
        assert server.state.metrics_requests >= 3
        # the server does refuse /metrics without it
        with T.Telemetry(server.url, tmp_path / "without", interval_s=0.2, settle_s=0.0) as tel:
            with tel.level(1):
                pass
        assert R.failures(R.load_level(tmp_path / "without", 1))[0][1].startswith("HTTP 401")
    finally:
        server.stop()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.parent.name == "telemetry" for p in files)
    assert [p for p in files if KEY.encode() in p.read_bytes()] == []


def test_telemetry_off_leaves_no_file_and_removes_a_stale_one(server, tmp_path):
    stale = R.level_path(tmp_path, 1)
    stale.parent.mkdir(parents=True)
    pd.DataFrame([(1, 0, 0.0, "telemetry", "scrape_ok", "{}", 1.0)], columns=TELEMETRY_COLUMNS).to_parquet(stale)
    _, levels = run_sweep(_cfg(server.url, levels=[1], interval_s=0), tmp_path, progress=False)
    assert not stale.exists() and server.state.metrics_requests == 0
    assert not [c for c in levels.columns if c.startswith(("server_", "telemetry_", "gpu_"))]


def test_samples_reach_the_file_while_the_level_runs(server, tmp_path):
    with T.Telemetry(server.url, tmp_path, interval_s=0.1, flush_s=0.2, settle_s=0.0) as tel:
        with tel.level(8):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                p = R.level_path(tmp_path, 8)
                if p.exists() and pd.read_parquet(p)["scrape"].max() >= 3:
                    break
                time.sleep(0.1)
            during = pd.read_parquet(R.level_path(tmp_path, 8))
    assert during["scrape"].max() >= 3          # a crash now would keep these
    assert len(pd.read_parquet(R.level_path(tmp_path, 8))) > len(during)


def test_a_telemetry_process_that_dies_leaves_the_level_recorded_and_the_sweep_going(server, tmp_path):
    lines = []
    with T.Telemetry(server.url, tmp_path, interval_s=0.2, settle_s=0.0, log=lines.append) as tel:
        tel.proc.kill()
        tel.proc.wait()
        with tel.level(2):
            tel.mark()
    summary = R.level_telemetry(tmp_path, 2)
    assert summary["telemetry_scrape_failures"] == summary["telemetry_scrapes"] == 1
    assert lines and "goes on without it" in lines[0]


# ---- parsing and summarising a real vLLM exposition -------------------------------------------------
class _Replay:
    """A Scraper that answers with the given exposition texts, one per sample, a second apart."""

    def __init__(self, texts):
        self.texts, self.t = list(texts), 1000.0

    def scrape(self):
        self.t += 1.0
        return self.t, 0.002, P.parse_metrics(self.texts.pop(0)), None


def _summary_of(before: str, after: str) -> dict:
    log = T.LevelLog(4, Path("/nonexistent"))
    replay = _Replay([before, before, after, after])
    log.sample(replay, None, mark="level_start")
    log.sample(replay, None, mark=R.MEASURED_START)
    log.sample(replay, None)
    log.sample(replay, None, mark="level_end")
    return R.summarize(pd.DataFrame(log.rows, columns=TELEMETRY_COLUMNS))


def _check_real_exposition(directory: Path):
    truth = json.loads((directory / "truth.json").read_text())
    after = (directory / "scrape_1.txt").read_text()
    samples = {(n, json.dumps(l, sort_keys=True)): v for n, l, v in P.parse_metrics(after)}
    labels = json.dumps({"engine": "0", "model_name": truth["served_model_name"]}, sort_keys=True)
    assert samples[("vllm:num_requests_running", labels)] == truth["running"]
    assert samples[("vllm:kv_cache_usage_perc", labels)] == truth["kv_cache_usage"]
    assert samples[("vllm:num_preemptions_total", labels)] == truth["preemptions"]
    assert samples[("vllm:request_time_per_output_token_seconds_count", labels)] == len(truth["tpot_s"])
    assert not [n for n, _ in samples if n.endswith(("_bucket", "_created"))]
    assert not [n for n, _ in samples if not n.startswith("vllm:") and n not in P.PROCESS_SAMPLES]
    s = _summary_of((directory / "scrape_0.txt").read_text(), after)
    spec = truth["spec"]
    assert s["server_running_mean"] == truth["running"] and s["server_waiting_max"] == truth["waiting"]
    assert s["server_kv_usage_max_pct"] == pytest.approx(100 * truth["kv_cache_usage"])
    assert s["server_preemptions"] == truth["preemptions"]
    assert s["server_tpot_mean_us"] == pytest.approx(_mean(truth["tpot_s"]) * 1e6)
    assert s["server_ttft_mean_us"] == pytest.approx(_mean(truth["ttft_s"]) * 1e6)
    assert s["server_itl_mean_us"] == pytest.approx(_mean(truth["itl_s"]) * 1e6)
    assert s["server_e2e_mean_us"] == pytest.approx(_mean(truth["e2e_s"]) * 1e6)
    assert s["server_spec_acceptance_pct"] == pytest.approx(
        100 * spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    assert s["server_spec_accept_len"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])


def test_a_real_vllm_exposition_parses_and_summarises_to_what_was_recorded():
    _check_real_exposition(FIXTURE)


@pytest.mark.integration
def test_the_installed_vllm_still_exposes_what_the_summary_reads(tmp_path):
    """The fixture made again by the installed vLLM's own stat logger: a rename in a vLLM upgrade fails here."""
    pytest.importorskip("vllm")
    from tests.make_vllm_metrics import make

    make(tmp_path)
    _check_real_exposition(tmp_path)


def test_an_older_vllm_without_the_per_request_tpot_falls_back_to_inter_token_latency():
    def older(text):   # vLLM before 0.11: time_per_output_token_seconds, gpu_cache_usage_perc
        keep = [ln for ln in text.splitlines() if "request_time_per_output_token" not in ln
                and "inter_token_latency" not in ln]
        return "\n".join(keep).replace("kv_cache_usage_perc", "gpu_cache_usage_perc") + "\n" + "\n".join(
            ln.replace("inter_token_latency", "time_per_output_token") for ln in text.splitlines()
            if "inter_token_latency" in ln) + "\n"
    truth = json.loads((FIXTURE / "truth.json").read_text())
    s = _summary_of(older((FIXTURE / "scrape_0.txt").read_text()), older((FIXTURE / "scrape_1.txt").read_text()))
    assert s["server_tpot_mean_us"] == pytest.approx(_mean(truth["itl_s"]) * 1e6)
    assert s["server_itl_mean_us"] == pytest.approx(_mean(truth["itl_s"]) * 1e6)
    assert s["server_kv_usage_max_pct"] == pytest.approx(100 * truth["kv_cache_usage"])


def test_a_counter_that_goes_back_gives_no_delta():
    truth_after = (FIXTURE / "scrape_1.txt").read_text()
    s = _summary_of(truth_after, (FIXTURE / "scrape_0.txt").read_text())   # a restart between the samples
    assert pd.isna(s["server_preemptions"]) and pd.isna(s["server_tpot_mean_us"])


# ---- NVML --------------------------------------------------------------------------------------------
class FakeNvml:
    """pynvml's calls for two GPUs; GPU 1 does not report its temperature."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    class NVMLError_NotSupported(Exception):
        pass

    def __init__(self):
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_500 + h * 1000          # milliwatts

    def nvmlDeviceGetClockInfo(self, h, clock):
        assert clock == self.NVML_CLOCK_SM
        return 1980 - 100 * h

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=97, memory=60)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=80 * 2**30, total=141 * 2**30)

    def nvmlDeviceGetTemperature(self, h, sensor):
        if h == 1:
            raise self.NVMLError_NotSupported()
        return 71

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return 0x4 | (0x8 if h == 1 else 0)


def test_nvml_samples_each_gpu_with_throttle_reasons_by_name():
    nvml = FakeNvml()
    sampler = T.NvmlSampler(nvml=nvml)
    assert sampler.reason is None and len(sampler.handles) == 2
    rows = {(name, labels.get("gpu")): (labels, value) for name, labels, value in sampler.sample()}
    assert rows[("power_w", "0")][1] == pytest.approx(350.5) and rows[("sm_clock_mhz", "1")][1] == 1880
    assert rows[("util_pct", "0")][1] == 97 and rows[("mem_used_mib", "1")][1] == 80 * 1024
    assert ("temp_c", "0") in rows and ("temp_c", "1") not in rows        # not reported: left out
    assert rows[("throttle_reasons", "0")][0]["reasons"] == "sw_power_cap"
    assert rows[("throttle_reasons", "1")] == ({"gpu": "1", "reasons": "sw_power_cap,hw_slowdown"}, 12.0)
    sampler.close()
    assert nvml.shut


def test_gpu_samples_are_summarised_per_level():
    log = T.LevelLog(2, Path("/nonexistent"))
    replay = _Replay([""] * 4)
    gpus = T.NvmlSampler(nvml=FakeNvml())
    for mark in ("level_start", R.MEASURED_START, None, "level_end"):
        log.sample(replay, gpus, mark=mark)
    s = R.summarize(pd.DataFrame(log.rows, columns=TELEMETRY_COLUMNS))
    assert s["gpu_power_mean_w"] == pytest.approx(351.0) and s["gpu_power_max_w"] == pytest.approx(351.5)
    assert s["gpu_sm_clock_min_mhz"] == 1880 and s["gpu_temp_max_c"] == 71
    assert s["gpu_throttle_reasons"] == "sw_power_cap, hw_slowdown"
    _, gpu = R.timeseries(pd.DataFrame(log.rows, columns=TELEMETRY_COLUMNS))
    assert sorted(set(gpu["gpu"])) == [0, 1] and {"power_w", "sm_clock_mhz", "sweep_s"} <= set(gpu.columns)


def test_no_nvml_is_a_reason_not_an_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *a, **kw):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    sampler = T.NvmlSampler(base_url="http://127.0.0.1:8000")
    assert sampler.sample() == [] and "not installed" in sampler.reason


def test_gpus_of_this_host_are_not_sampled_for_a_server_on_another():
    sampler = T.NvmlSampler(nvml=FakeNvml(), base_url="http://gpu-box.example.invalid:8000")
    assert sampler.sample() == [] and "another host" in sampler.reason


def test_the_reason_for_no_gpu_samples_is_in_the_level_file(server, tmp_path):
    with T.Telemetry(server.url, tmp_path, interval_s=0.2, settle_s=0.0, gpu=False) as tel:
        with tel.level(1):
            pass
    assert R.gpu_unavailable(R.load_level(tmp_path, 1)) == "GPU sampling is off"


def test_throttle_names_decode_every_known_bit_and_keep_unknown_ones():
    assert R.throttle_names(0) == []
    assert R.throttle_names(0x1 | 0x40) == ["gpu_idle", "hw_thermal_slowdown"]
    assert R.throttle_names(0x4 | 0x1000) == ["sw_power_cap", "0x1000"]


# ---- params, tables and the plot -------------------------------------------------------------------
@pytest.mark.parametrize("value,ok", [(1.0, True), (0, True), (0.25, True), (-1, False), (0.01, False)])
def test_the_interval_knob_is_zero_or_at_least_a_tenth_of_a_second(write_params, tmp_path, value, ok):
    from decodescope.schema.params import ParamsError, load_params

    p = write_params(f"model:\n  name: tiny\n  config: models/tiny-qwen3-moe.json\nserver:\n  tensor_parallel: 2\n"
                     f"run:\n  output_dir: {tmp_path}\nworkload:\n  telemetry_interval_s: {value}\n")
    if ok:
        assert load_params(p).workload.telemetry_interval_s == value
    else:
        with pytest.raises(ParamsError, match="workload.telemetry_interval_s"):
            load_params(p)


def test_the_notebooks_tables_and_plot_read_a_sweeps_telemetry(server, tmp_path):
    from decodescope.report import plots
    from decodescope.report.serving_view import server_vs_client_table, telemetry_note, telemetry_table

    _, levels = run_sweep(_cfg(server.url), tmp_path, progress=False)
    t = server_vs_client_table(levels)
    assert list(t["concurrency"]) == [1, 2]
    assert t["client - server ms"].tolist() == pytest.approx(
        ((levels["tpot_mean_us"] - levels["server_tpot_mean_us"]) / 1e3).tolist())
    assert "preemptions" in telemetry_table(levels).columns
    telemetry = R.load_telemetry(tmp_path)
    assert "no GPU samples" in telemetry_note(telemetry)
    fig = plots.telemetry_over_time(*R.timeseries(telemetry))
    assert {tr.name for tr in fig.data} == {"running", "waiting", "KV cache"}
    assert plots.telemetry_over_time(*R.timeseries(R.load_telemetry(tmp_path / "none"))) is None
    assert server_vs_client_table(levels.drop(columns=["server_tpot_mean_us"])).empty


@pytest.mark.gpu
def test_nvml_on_a_gpu_host_reports_power_clock_and_reasons_for_every_gpu():
    sampler = T.NvmlSampler(base_url="http://127.0.0.1:8000")
    assert sampler.reason is None, sampler.reason
    rows = sampler.sample()
    gpus = {labels["gpu"] for _, labels, _ in rows}
    assert len(gpus) == len(sampler.handles) >= 1
    for name in ("power_w", "sm_clock_mhz", "util_pct", "mem_used_mib", "throttle_reasons"):
        assert len([r for r in rows if r[0] == name]) == len(gpus), name
    assert all(v > 0 for n, _, v in rows if n in ("power_w", "sm_clock_mhz", "mem_used_mib"))
    sampler.close()


def test_a_histograms_mean_between_two_scrapes_is_its_new_observations_only():
    reg = CollectorRegistry()
    h = Histogram("vllm:inter_token_latency_seconds", "itl", ["engine"], registry=reg)
    for v in (0.010, 0.030):
        h.labels(engine="0").observe(v)
    before = P.parse_metrics(generate_latest(reg).decode())
    for v in (0.002, 0.004):                   # the window's observations, on two engines
        h.labels(engine="0").observe(v)
    h.labels(engine="1").observe(0.006)
    after = P.parse_metrics(generate_latest(reg).decode())
    names = P.HISTOGRAM_MEANS["server_itl_mean_us"]
    assert P.histogram_mean_between(before, after, names) == pytest.approx(0.004)
    assert P.histogram_mean_between(after, after, names) is None      # nothing observed
    assert P.histogram_mean_between(None, after, names) is None       # a failed scrape
    assert P.histogram_mean_between(before, after, ("vllm:absent_seconds",)) is None


def test_the_engines_steps_between_two_scrapes_are_its_iteration_histograms_new_count():
    reg = CollectorRegistry()
    h = Histogram("vllm:iteration_tokens_total", "tokens per engine step", ["engine"], registry=reg)
    for n in (4, 4, 1):
        h.labels(engine="0").observe(n)
    before = P.parse_metrics(generate_latest(reg).decode())
    for n in (2, 3, 3, 3):
        h.labels(engine="0").observe(n)
    h.labels(engine="1").observe(1)
    after = P.parse_metrics(generate_latest(reg).decode())
    assert P.counter_delta(before, after, P.ENGINE_STEPS) == 5.0
    assert P.counter_delta(None, after, P.ENGINE_STEPS) is None               # a failed scrape
    assert P.counter_delta(before, after, "vllm:absent_total") is None       # not exposed


def test_a_process_cpu_time_and_run_queue_wait_are_read_per_step_from_proc():
    """Two busy loops pinned to one core: each is always ready to run, so its CPU time and its run-queue
    wait add up to the window, and with the core shared it waits a good part of it."""
    import subprocess
    import sys
    import time

    from decodescope.exec import procs

    # The spinners run until killed (the finally below kills and reaps them): a spinner that ended itself after a
    # fixed time could end inside the window on CI's loaded 2-core machine (the two starts' skew plus the
    # window's oversleep), and the window would then read one process and too little CPU time.
    code = ("import os\nos.sched_setaffinity(0, {0})\nprint('spinning', flush=True)\n"
            "while True: pass")
    kids: list[subprocess.Popen] = []
    try:
        for _ in range(2):  # each one in kids as soon as it is started, so that the finally kills it
            kids.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
        assert all(k.stdout.readline().strip() == "spinning" for k in kids)
        before, t0 = procs.cpu_schedstat([k.pid for k in kids] + [999_999_999]), time.monotonic()  # gone: left out
        time.sleep(1.0)
        after, window_us = procs.cpu_schedstat([k.pid for k in kids]), (time.monotonic() - t0) * 1e6
    finally:
        for k in kids:
            k.kill()
            k.wait()
    assert set(before) == {k.pid for k in kids} and {r for r, _, _ in after.values()} == {"api server"}
    p = procs.cpu_per_step(before, after, steps=1000)              # per step of a thousandth of the window
    assert p["api server"]["processes"] == 2
    step_us = window_us / 1000
    assert 0.7 * step_us <= p["api server"]["cpu_us"] + p["api server"]["runq_wait_us"] <= 1.3 * step_us, p
    assert p["api server"]["cpu_us"] > 0 and p["api server"]["runq_wait_us"] >= 0.2 * step_us, p
    assert procs.named_role("VLLM::Worker_TP0") == "worker" and procs.named_role("VLLM::EngineCore") == "engine core"
