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

Rows and their summary: decodescope.serving.telemetry_read; the samples kept: decodescope.serving.promtext.
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

import pandas as pd

from decodescope.core.io import write_parquet_atomic
from decodescope.schema.records_serving import TELEMETRY_COLUMNS
from decodescope.serving.promtext import SCRAPE_TIMEOUT_S, Scraper
from decodescope.serving.telemetry_read import MEASURED_START, labels_json, level_path, throttle_names

SETTLE_S = 0.25          # after the last request, before the closing sample: the engine records its stats
FLUSH_S = 5.0            # the level's file is rewritten at most this often (more rarely when it grows)


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
                # pynvml: the gpu extra only (nvidia-ml-py)
                import pynvml
            except ImportError:
                self.reason = "pynvml (nvidia-ml-py) is not installed"
                return
            nvml = pynvml
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
        self.rows.append((self.level, self.scrape, t_s, source, metric, labels_json(labels), value))

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
                assert log is not None  # get() times out only while a level's log is open (timeout None else)
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
        proc = self.proc
        assert proc is not None and proc.stdout is not None  # started by __enter__, stdout a pipe
        for line in proc.stdout:
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
            assert self.proc.stdin is not None  # started with stdin a pipe
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
            assert self.proc.stdin is not None  # started with stdin a pipe
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
    row = (level, 0, time.monotonic(), "telemetry", "scrape_ok", labels_json({"error": error}), 0.0)
    write_parquet_atomic(path, pd.DataFrame([row], columns=TELEMETRY_COLUMNS))





if __name__ == "__main__":
    sys.exit(serve(sys.stdin, sys.stdout))
