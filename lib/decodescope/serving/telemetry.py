"""Server and GPU telemetry during the serving sweep: the server's Prometheus `/metrics` and NVML, sampled
every `interval_s` while a level runs, one long table per level (data/telemetry/level_<c>.parquet).

The sampling runs in a child process (`python -m decodescope.serving.telemetry`), not in a thread of the
load generator: parsing one vLLM exposition takes milliseconds of Python, and in a thread it would hold
the GIL that the client's event loop needs to stamp chunk arrivals. The parent (`Telemetry`) talks to the
child over its stdin/stdout in JSON lines: `config` (the API key travels here, never in argv or the
environment), `level` (start a level's file; sample now), `mark` (sample now, tagged: the sweep marks the
start of the measured requests), `end` (sample once more after `settle_s`, write, close). The child writes
the level's file atomically every few seconds, so a crash keeps what was sampled; it exits on `quit`, on
its stdin closing (the parent died) or on SIGTERM, writing first. A scrape that fails is a row
(`scrape_ok` = 0 with the error), never an exception: the sweep goes on.

Rows (`records.TELEMETRY_COLUMNS`): level, scrape (the sample's number within the level), t_s
(CLOCK_MONOTONIC seconds, the clock of the request records' *_ns), source (`server`, `gpu` or
`telemetry`), metric (the exposition's sample name, e.g. `vllm:num_preemptions_total`,
`vllm:time_to_first_token_seconds_sum`; or a GPU field, e.g. `power_w`), labels (JSON, sorted keys), value.
Server samples kept: every `vllm:` sample but histogram buckets and `_created` (the summary uses a
histogram's `_sum` and `_count`), and the API server's `process_cpu_seconds_total` and
`process_resident_memory_bytes`.

`level_telemetry(data_dir, level)` is a level's summary (columns of `records.ServingLevel`): gauges over the
samples taken while the measured requests ran, counters and histogram means as differences between the
sample at the measured start and the one after the last request. Server-side TPOT is vLLM's
`request_time_per_output_token_seconds` (per request, (last token - first token) / (tokens - 1) in the
engine, as the client's TPOT); a vLLM without it falls back to the inter-token latency histogram
(`inter_token_latency_seconds`, older `time_per_output_token_seconds`), the same mean when every request
has the same output length (the sweep's `ignore_eos` requests do).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

from decodescope.rundir import level_file

TELEMETRY_DIR = "telemetry"
SCRAPE_TIMEOUT_S = 5.0
SETTLE_S = 0.25          # after the last request, before the closing sample: the engine records its stats
FLUSH_S = 5.0            # the level's file is rewritten at most this often (more rarely when it grows)
PROCESS_SAMPLES = ("process_cpu_seconds_total", "process_resident_memory_bytes")
MEASURED_START = "measured_start"

# Histograms whose mean over a level is a summary column: column -> sample bases, first found wins.
HISTOGRAM_MEANS = {
    "server_ttft_mean_us": ("vllm:time_to_first_token_seconds",),
    "server_tpot_mean_us": ("vllm:request_time_per_output_token_seconds", "vllm:inter_token_latency_seconds",
                            "vllm:time_per_output_token_seconds"),
    "server_itl_mean_us": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "server_e2e_mean_us": ("vllm:e2e_request_latency_seconds",),
    "server_queue_mean_us": ("vllm:request_queue_time_seconds",),
}
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")   # a fraction, despite the name

# NVML's clock event ("throttle") reasons, nvml.h's bit values.
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    """The reasons set in an NVML clock-event bitmask, by name (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    rest = mask & ~sum(THROTTLE_REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


def level_path(data_dir: Path, level: int, repeat: int = 1) -> Path:
    """data/telemetry/level_<c>.parquet; a repeat after the first: level_<c>_r<n>.parquet."""
    return Path(data_dir) / TELEMETRY_DIR / level_file(level, repeat)


def _labels(d: dict) -> str:
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _redact(text: str, secret: Optional[str]) -> str:
    return text.replace(secret, "***") if secret else text


# ---- the server's /metrics -------------------------------------------------------------------------
def _kept(name: str) -> bool:
    if name.startswith("vllm:"):
        return not name.endswith(("_bucket", "_created"))
    return name in PROCESS_SAMPLES


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) of the samples kept (module docstring), from Prometheus text. Lines of
    other metrics are dropped before parsing, which keeps a scrape's cost to the samples kept."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = [ln for ln in text.splitlines()
             if ln and not ln.startswith("#") and _kept(ln.split("{", 1)[0].split(None, 1)[0])]
    if not lines:
        return []
    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families("\n".join(lines) + "\n") for s in fam.samples]


class Scraper:
    """GET <base_url>/metrics with the API key as a bearer token (as the requests send it); no proxies."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout_s: float = SCRAPE_TIMEOUT_S):
        import urllib.request

        self.url = base_url.rstrip("/") + "/metrics"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def scrape(self) -> tuple[float, float, Optional[list], Optional[str]]:
        """(t_s, seconds it took, samples or None, error or None); never raises."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.api_key}"}
                                     if self.api_key else {})
        t0 = time.monotonic()
        try:
            with self._opener.open(req, timeout=self.timeout_s) as r:
                text = r.read().decode("utf-8", errors="replace")
            t1 = time.monotonic()
            return (t0 + t1) / 2, t1 - t0, parse_metrics(text), None
        except urllib.error.HTTPError as e:
            err = f"HTTP {e.code} from {self.url}"
        except (urllib.error.URLError, OSError) as e:     # refused, reset, timed out
            reason = getattr(e, "reason", e)
            err = f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
        except Exception as e:                            # a body the parser refuses
            err = f"{type(e).__name__}: {e}"
        t1 = time.monotonic()
        return (t0 + t1) / 2, t1 - t0, None, _redact(err, self.api_key)[:500]


def _total(samples: list, name: str) -> Optional[float]:
    vals = [v for n, _, v in samples if n == name]
    return sum(vals) if vals else None


def histogram_mean_between(before: Optional[list], after: Optional[list], names) -> Optional[float]:
    """The mean of the first of `names` (histogram bases) the server exposes, over the observations
    made between two scrapes (parse_metrics samples): delta of _sum over delta of _count, all label sets
    together; None when a scrape failed, the histogram is absent or nothing was observed."""
    if not before or not after:
        return None
    for base in names:
        s0, s1 = _total(before, base + "_sum"), _total(after, base + "_sum")
        c0, c1 = _total(before, base + "_count"), _total(after, base + "_count")
        if None in (s0, s1, c0, c1):
            continue
        return (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return None


ENGINE_STEPS = "vllm:iteration_tokens_total_count"   # one observation per engine iteration (step)


def counter_delta(before: Optional[list], after: Optional[list], name: str) -> Optional[float]:
    """How much a counter (or a histogram's _count) grew between two scrapes; None when either
    scrape failed or the server does not expose it."""
    if not before or not after:
        return None
    a, b = _total(before, name), _total(after, name)
    return None if a is None or b is None else b - a


# ---- NVML ------------------------------------------------------------------------------------------
def _is_local(base_url: str) -> bool:
    host = urlsplit(base_url).hostname or ""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127."):
        return True
    try:
        return host in {socket.gethostname(), socket.getfqdn()} or host in {
            a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False


class NvmlSampler:
    """Per GPU: power_w, sm_clock_mhz, util_pct, mem_util_pct, mem_used_mib, temp_c and throttle_reasons (the
    bitmask as the value, its names in the labels). `reason` says why there are no GPU samples (no pynvml,
    no GPU, the server on another host); a field the GPU does not report is left out."""

    def __init__(self, nvml: Any = None, base_url: Optional[str] = None):
        self.nvml, self.handles, self.reason = None, [], None
        if base_url is not None and not _is_local(base_url):
            self.reason = f"the server ({urlsplit(base_url).hostname}) is on another host; its GPUs are not this host's"
            return
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                self.reason = "pynvml (nvidia-ml-py) is not installed"
                return
        try:
            nvml.nvmlInit()
            self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as e:    # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            self.reason = f"NVML did not start: {type(e).__name__}: {e}"
            return
        if not self.handles:
            self.reason = "NVML found no GPU"
            return
        self.nvml = nvml
        self._reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))

    def sample(self) -> list[tuple[str, dict, float]]:
        if self.nvml is None:
            return []
        n, out = self.nvml, []
        fields: list[tuple[str, Callable[[Any], float]]] = [
            ("power_w", lambda h: n.nvmlDeviceGetPowerUsage(h) / 1e3),
            ("sm_clock_mhz", lambda h: n.nvmlDeviceGetClockInfo(h, getattr(n, "NVML_CLOCK_SM", 1))),
            ("util_pct", lambda h: n.nvmlDeviceGetUtilizationRates(h).gpu),
            ("mem_util_pct", lambda h: n.nvmlDeviceGetUtilizationRates(h).memory),
            ("mem_used_mib", lambda h: n.nvmlDeviceGetMemoryInfo(h).used / 2**20),
            ("temp_c", lambda h: n.nvmlDeviceGetTemperature(h, getattr(n, "NVML_TEMPERATURE_GPU", 0))),
        ]
        for i, h in enumerate(self.handles):
            for name, get in fields:
                try:
                    out.append((name, {"gpu": str(i)}, float(get(h))))
                except Exception:     # NVMLError_NotSupported and the like: the field is left out
                    pass
            if self._reasons is not None:
                try:
                    mask = int(self._reasons(h))
                    out.append(("throttle_reasons", {"gpu": str(i), "reasons": ",".join(throttle_names(mask))},
                                float(mask)))
                except Exception:
                    pass
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass


# ---- the child process -----------------------------------------------------------------------------
class LevelLog:
    """One level's rows, written atomically to its file now and then and at the end."""

    def __init__(self, level: int, path: Path, flush_s: float = FLUSH_S):
        self.level, self.path, self.flush_s = level, Path(path), flush_s
        self.rows: list[tuple] = []
        self.scrape = 0
        self._written = 0
        self._last_flush = time.monotonic()

    def add(self, t_s: float, source: str, metric: str, labels: dict, value: float) -> None:
        self.rows.append((self.level, self.scrape, t_s, source, metric, _labels(labels), value))

    def sample(self, scraper: Scraper, gpus: Optional[NvmlSampler], mark: Optional[str] = None) -> None:
        t_s, took_s, samples, err = scraper.scrape()
        if mark:
            self.add(t_s, "telemetry", "mark", {"mark": mark}, 1.0)
        self.add(t_s, "telemetry", "scrape_ok", {"error": err} if err else {}, 0.0 if err else 1.0)
        self.add(t_s, "telemetry", "scrape_ms", {}, took_s * 1e3)
        for name, labels, value in samples or ():
            self.add(t_s, "server", name, labels, value)
        if gpus is not None and gpus.nvml is not None:
            t_g = time.monotonic()
            for name, labels, value in gpus.sample():
                self.add(t_g, "gpu", name, labels, value)
        self.scrape += 1

    def flush(self, force: bool = False) -> None:
        if not force and (time.monotonic() - self._last_flush < self.flush_s or len(self.rows) == self._written):
            return
        import pandas as pd

        from decodescope.io import write_parquet_atomic
        from decodescope.records import TELEMETRY_COLUMNS

        t0 = time.monotonic()
        write_parquet_atomic(self.path, pd.DataFrame(self.rows, columns=TELEMETRY_COLUMNS))
        self._written, self._last_flush = len(self.rows), time.monotonic()
        # rewriting a growing file: at most ~2% of a core, and at least once a minute
        self.flush_s = min(max(self.flush_s, 50 * (self._last_flush - t0)), 60.0)


class _Stop(Exception):
    pass


def serve(stdin, stdout) -> int:
    """The child's loop (module docstring): commands from stdin, acknowledgements to stdout."""
    def reply(**kw):
        stdout.write(json.dumps(kw) + "\n")
        stdout.flush()

    def on_term(*_):
        raise _Stop()
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the parent, which ends the level

    cfg = json.loads(stdin.readline() or "{}")
    import pandas  # noqa: F401  (before the first write, so no sample waits for these imports)
    import pyarrow.parquet  # noqa: F401
    commands: queue.Queue = queue.Queue()

    def read():
        for line in stdin:
            try:
                commands.put(json.loads(line))
            except json.JSONDecodeError:
                pass
        commands.put(None)                          # the parent closed our stdin (or died)
    threading.Thread(target=read, daemon=True).start()

    interval = float(cfg.get("interval_s", 1.0))
    scraper = Scraper(cfg["base_url"], cfg.get("api_key"), float(cfg.get("scrape_timeout_s", SCRAPE_TIMEOUT_S)))
    gpus = NvmlSampler(base_url=cfg["base_url"]) if cfg.get("gpu", True) else None
    gpu_reason = gpus.reason if gpus is not None else "GPU sampling is off"
    reply(ok=True, gpus=len(gpus.handles) if gpus else 0, gpu_reason=gpu_reason)
    log: Optional[LevelLog] = None
    next_t = float("inf")
    try:
        while True:
            timeout = max(0.0, next_t - time.monotonic()) if log is not None else None
            try:
                cmd = commands.get(timeout=timeout)
            except queue.Empty:
                log.sample(scraper, gpus)
                log.flush()
                next_t += interval
                if next_t <= time.monotonic():          # a slow scrape: skip the ticks it covered
                    next_t = time.monotonic() + interval
                continue
            what = cmd.get("cmd") if isinstance(cmd, dict) else None
            if cmd is None or what == "quit":
                break
            if what == "level":
                if log is not None:                     # a level the parent did not end
                    log.flush(force=True)
                log = LevelLog(int(cmd["level"]), Path(cmd["path"]), float(cfg.get("flush_s", FLUSH_S)))
                if gpu_reason:
                    log.add(time.monotonic(), "telemetry", "gpu_unavailable", {"reason": gpu_reason}, 1.0)
                log.sample(scraper, gpus, mark="level_start")
                log.flush(force=True)
                next_t = time.monotonic() + interval
                reply(ok=True)
            elif what == "mark" and log is not None:
                log.sample(scraper, gpus, mark=str(cmd.get("name", "mark")))
                reply(ok=True)
            elif what == "end" and log is not None:
                time.sleep(float(cfg.get("settle_s", SETTLE_S)))
                log.sample(scraper, gpus, mark="level_end")
                log.flush(force=True)
                reply(ok=True, rows=len(log.rows))
                log, next_t = None, float("inf")
            else:
                reply(ok=False, error=f"unexpected command {what!r}")
    except (_Stop, KeyboardInterrupt):
        pass
    finally:
        if log is not None:
            log.flush(force=True)
        if gpus is not None:
            gpus.close()
    return 0


# ---- the parent (the sweep's side) -----------------------------------------------------------------
class TelemetryError(RuntimeError):
    pass


class Telemetry:
    """The sampling child for one sweep. `with Telemetry(...) as tel:` then, per level,
    `with tel.level(c):` (marking the measured start with `tel.mark()`); every failure of the child is a
    console line and a row in the level's file, never an exception out of the sweep."""

    def __init__(self, base_url: str, data_dir: Path, interval_s: float = 1.0, api_key: Optional[str] = None,
                 gpu: bool = True, settle_s: float = SETTLE_S, flush_s: float = FLUSH_S,
                 scrape_timeout_s: float = SCRAPE_TIMEOUT_S, log: Optional[Callable[[str], None]] = None,
                 stderr: Any = None):
        self.data_dir = Path(data_dir)
        self.config = {"base_url": base_url, "api_key": api_key, "interval_s": interval_s, "gpu": gpu,
                       "settle_s": settle_s, "flush_s": flush_s, "scrape_timeout_s": scrape_timeout_s}
        self.ack_timeout_s = scrape_timeout_s + settle_s + 30.0
        self.log = log or (lambda line: None)
        self.stderr = stderr      # the child's (a kernel's fd 2 would copy it into the notebook)
        self.proc: Optional[subprocess.Popen] = None
        self.gpu_reason: Optional[str] = None
        self.error: Optional[str] = None
        self._replies: queue.Queue = queue.Queue()
        self._level: Optional[int] = None

    def __enter__(self) -> "Telemetry":
        # this decodescope, whatever the working directory and however it was put on sys.path
        lib = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (lib, os.environ.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "decodescope.serving.telemetry"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                         text=True, bufsize=1,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
        except OSError as e:
            self._fail(f"the telemetry process did not start: {e}")
            return self
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._send({**self.config})
        if ready is not None:
            self.gpu_reason = ready.get("gpu_reason")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._replies.put(json.loads(line))
            except json.JSONDecodeError:
                pass
        self._replies.put(None)

    def _fail(self, error: str) -> None:
        if self.error is None:
            self.log(f"telemetry: {error}; the sweep goes on without it")
        self.error = error
        self._kill()

    def _send(self, cmd: dict) -> Optional[dict]:
        """One command and its acknowledgement; None (and the child stopped) when it does not answer."""
        if self.proc is None or self.error is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            reply = self._replies.get(timeout=self.ack_timeout_s)
        except (OSError, ValueError):
            reply = None
        except queue.Empty:
            self._fail(f"the telemetry process did not answer {cmd.get('cmd', 'config')!r} within "
                       f"{self.ack_timeout_s:.0f} s")
            return None
        if reply is None:
            self._fail(f"the telemetry process exited (code {self.proc.poll()})")
        return reply

    @contextmanager
    def level(self, level: int, repeat: int = 1) -> Iterator["Telemetry"]:
        """Samples from now until the block ends (also by an exception or Ctrl-C), into the level's file."""
        path = level_path(self.data_dir, level, repeat)
        path.unlink(missing_ok=True)    # a file of an earlier measurement of this level describes another one
        self._level = level
        if self._send({"cmd": "level", "level": level, "path": str(path)}) is None:
            _write_failure(path, level, self.error or "the telemetry process is not running")
        try:
            yield self
        finally:
            self._level = None
            if self._send({"cmd": "end"}) is None and not path.exists():
                _write_failure(path, level, self.error or "the telemetry process is not running")

    def mark(self, name: str = MEASURED_START) -> None:
        """A sample now, tagged `name` (the sweep marks the start of the measured requests)."""
        if self._level is not None:
            self._send({"cmd": "mark", "name": name})

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
        self.proc = None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()             # SIGTERM: the child writes what it has, then exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


class NoTelemetry:
    """Telemetry off (`workload.telemetry_interval_s: 0`): levels measured now leave no telemetry file."""

    gpu_reason = error = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)

    @contextmanager
    def level(self, level: int, repeat: int = 1):
        level_path(self.data_dir, level, repeat).unlink(missing_ok=True)
        yield self

    def mark(self, name: str = MEASURED_START) -> None:
        pass


def _write_failure(path: Path, level: int, error: str) -> None:
    import pandas as pd

    from decodescope.io import write_parquet_atomic
    from decodescope.records import TELEMETRY_COLUMNS

    row = (level, 0, time.monotonic(), "telemetry", "scrape_ok", _labels({"error": error}), 0.0)
    write_parquet_atomic(path, pd.DataFrame([row], columns=TELEMETRY_COLUMNS))


# ---- reading and summarising -----------------------------------------------------------------------
def load_level(data_dir: Path, level: int, repeat: int = 1):
    """A level's telemetry rows, or None when the level has no telemetry file."""
    import pandas as pd

    p = level_path(data_dir, level, repeat)
    return pd.read_parquet(p) if p.exists() else None


def load_telemetry(data_dir: Path):
    """Every level's telemetry rows (an empty frame with the columns when there are none)."""
    import pandas as pd

    from decodescope.records import TELEMETRY_COLUMNS

    parts = [pd.read_parquet(p) for p in sorted((Path(data_dir) / TELEMETRY_DIR).glob("level_*.parquet"))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=TELEMETRY_COLUMNS)


def _mark_scrape(df, name: str) -> Optional[int]:
    m = df[(df["source"] == "telemetry") & (df["metric"] == "mark") & (df["labels"] == _labels({"mark": name}))]
    return int(m["scrape"].iloc[0]) if len(m) else None


def _per_scrape(server, names, agg: str = "sum"):
    """Per scrape, `agg` over label sets (engines) of the first of `names` the server exposes; None if none.
    Counters and request counts add up over engines; a usage fraction takes the fullest one (max)."""
    for name in names:
        s = server[server["metric"] == name]
        if len(s):
            return s.groupby("scrape")["value"].agg(agg)
    return None


def _delta(series, a: int, b: int) -> float:
    """series[b] - series[a]; NaN when either scrape is missing or the counter went back (a restart)."""
    if series is None or a not in series.index or b not in series.index:
        return float("nan")
    d = float(series[b] - series[a])
    return d if d >= 0 else float("nan")


def summarize(df) -> dict:
    """A level's summary (module docstring) from its telemetry rows; NaN where nothing was measured."""
    import numpy as np

    nan = float("nan")
    tel = df[df["source"] == "telemetry"]
    ok = tel[tel["metric"] == "scrape_ok"]
    out: dict = {"telemetry_scrapes": int(len(ok)), "telemetry_scrape_failures": int((ok["value"] == 0).sum())}
    server = df[df["source"] == "server"]
    scrapes = sorted(set(server["scrape"]))
    # The window: from the first successful sample at or after the measured start (the level's first
    # without a mark) to the last one, taken after the last request ended.
    start_mark = _mark_scrape(df, MEASURED_START)
    after = [s for s in scrapes if start_mark is None or s >= start_mark]
    a, b = (after[0], after[-1]) if after else (None, None)
    end_mark = _mark_scrape(df, "level_end")
    # Gauges: the samples strictly inside the window (its ends have no request in flight).
    inside = [s for s in scrapes if a is not None and a < s < (end_mark if end_mark is not None else b + 1)]

    def gauge(names, how, scale=1.0, agg="sum"):
        s = _per_scrape(server, names, agg)
        if s is None:
            return nan
        s = s[s.index.isin(inside)]
        return float(getattr(s, how)()) * scale if len(s) else nan

    out["server_running_mean"] = gauge(("vllm:num_requests_running",), "mean")
    out["server_running_max"] = gauge(("vllm:num_requests_running",), "max")
    out["server_waiting_mean"] = gauge(("vllm:num_requests_waiting",), "mean")
    out["server_waiting_max"] = gauge(("vllm:num_requests_waiting",), "max")
    out["server_kv_usage_max_pct"] = gauge(KV_USAGE, "max", 100.0, agg="max")
    out["server_preemptions"] = _delta(_per_scrape(server, ("vllm:num_preemptions_total",)), a, b)
    for col, bases in HISTOGRAM_MEANS.items():
        out[col] = nan
        for base in bases:
            d_sum = _delta(_per_scrape(server, (f"{base}_sum",)), a, b)
            d_count = _delta(_per_scrape(server, (f"{base}_count",)), a, b)
            if d_count == d_count:      # the histogram is there
                out[col] = d_sum / d_count * 1e6 if d_count > 0 else nan
                break
    drafts = _delta(_per_scrape(server, ("vllm:spec_decode_num_drafts_total",)), a, b)
    draft_tokens = _delta(_per_scrape(server, ("vllm:spec_decode_num_draft_tokens_total",)), a, b)
    accepted = _delta(_per_scrape(server, ("vllm:spec_decode_num_accepted_tokens_total",)), a, b)
    out["server_spec_acceptance_pct"] = 100.0 * accepted / draft_tokens if draft_tokens > 0 else nan
    out["server_spec_accept_len"] = 1.0 + accepted / drafts if drafts > 0 else nan
    cpu = _delta(_per_scrape(server, ("process_cpu_seconds_total",)), a, b)
    t = server.groupby("scrape")["t_s"].first()
    span = float(t[b] - t[a]) if a is not None and b != a else nan
    out["server_api_cpu_pct"] = 100.0 * cpu / span if span == span and span > 0 else nan

    gpu = df[df["source"] == "gpu"]
    if len(gpu):
        g = gpu[gpu["scrape"].isin(inside)] if inside else gpu

        def field(name, how, default=nan):
            v = g.loc[g["metric"] == name, "value"]
            return float(getattr(v, how)()) if len(v) else default
        out.update(gpu_power_mean_w=field("power_w", "mean"), gpu_power_max_w=field("power_w", "max"),
                   gpu_sm_clock_mean_mhz=field("sm_clock_mhz", "mean"),
                   gpu_sm_clock_min_mhz=field("sm_clock_mhz", "min"),
                   gpu_util_mean_pct=field("util_pct", "mean"), gpu_mem_used_max_mib=field("mem_used_mib", "max"),
                   gpu_temp_max_c=field("temp_c", "max"))
        masks = g.loc[g["metric"] == "throttle_reasons", "value"].astype("int64")
        mask = int(np.bitwise_or.reduce(masks.to_numpy())) if len(masks) else 0
        out["gpu_throttle_reasons"] = ", ".join(throttle_names(mask))
    return out


def level_telemetry(data_dir: Path, level: int, repeat: int = 1) -> Optional[dict]:
    """The level's summary columns, or None when it has no telemetry file (telemetry off)."""
    df = load_level(data_dir, level, repeat)
    return None if df is None else summarize(df)


def timeseries(df):
    """(server, gpu): the samples over the sweep as two tables for plotting, each with `sweep_s` (seconds
    on one axis for the whole sweep: each level from its first sample, the levels end to end in the order
    they were measured, a second apart; levels measured across a restart have unrelated clocks).
    server: level, sweep_s, running, waiting, kv_usage_pct. gpu: level, sweep_s, gpu, power_w, sm_clock_mhz,
    util_pct, mem_used_mib (whichever were sampled)."""
    import pandas as pd

    if df.empty:
        return (pd.DataFrame(columns=["level", "sweep_s", "running", "waiting", "kv_usage_pct"]),
                pd.DataFrame(columns=["level", "sweep_s", "gpu"]))
    t0 = df.groupby("level")["t_s"].min().sort_values()
    span = df.groupby("level")["t_s"].max() - t0
    offset, at = {}, 0.0
    for level in t0.index:
        offset[level] = at
        at += float(span[level]) + 1.0
    d = df.assign(sweep_s=df["t_s"] - df["level"].map(t0) + df["level"].map(offset))
    srv = d[d["source"] == "server"]
    keys = ["level", "scrape"]
    server = srv.groupby(keys)["sweep_s"].first().to_frame()
    for col, names, agg, scale in (("running", ("vllm:num_requests_running",), "sum", 1.0),
                                   ("waiting", ("vllm:num_requests_waiting",), "sum", 1.0),
                                   ("kv_usage_pct", KV_USAGE, "max", 100.0)):
        for name in names:
            s = srv[srv["metric"] == name]
            if len(s):
                server[col] = s.groupby(keys)["value"].agg(agg) * scale
                break
    server = server.reset_index().drop(columns="scrape").sort_values("sweep_s")
    g = d[(d["source"] == "gpu") & (d["metric"] != "throttle_reasons")]
    if g.empty:
        return server, pd.DataFrame(columns=["level", "sweep_s", "gpu"])
    g = g.assign(gpu=[int(json.loads(x)["gpu"]) for x in g["labels"]])
    keys = ["level", "scrape", "gpu"]
    gpu = g.pivot_table(index=keys, columns="metric", values="value", aggfunc="first")
    gpu = gpu.join(g.groupby(keys)["sweep_s"].first()).reset_index().drop(columns="scrape")
    gpu.columns.name = None
    return server, gpu.sort_values(["sweep_s", "gpu"])


def failures(df) -> list[tuple[int, str, int]]:
    """(level, error, count) of the failed scrapes, the most frequent first."""
    bad = df[(df["source"] == "telemetry") & (df["metric"] == "scrape_ok") & (df["value"] == 0)]
    errs = bad.assign(error=[json.loads(x).get("error", "") for x in bad["labels"]])
    counts = errs.groupby(["level", "error"]).size().sort_values(ascending=False)
    return [(int(lv), str(e), int(n)) for (lv, e), n in counts.items()]


def gpu_unavailable(df) -> Optional[str]:
    """Why there are no GPU samples, as the child recorded it; None when there are (or no file says)."""
    r = df[(df["source"] == "telemetry") & (df["metric"] == "gpu_unavailable")]
    return json.loads(r["labels"].iloc[0]).get("reason") if len(r) else None


if __name__ == "__main__":
    sys.exit(serve(sys.stdin, sys.stdout))
