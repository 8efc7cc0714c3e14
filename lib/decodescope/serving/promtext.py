"""The server's Prometheus `/metrics`: the samples telemetry keeps (every `vllm:` sample but histogram
buckets and `_created`, and the API server's `process_cpu_seconds_total` and
`process_resident_memory_bytes`), a scraper that never raises, and the differences between two scrapes
(a histogram's mean, a counter's growth) that the profile phase and the telemetry summary read."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families
from decodescope.engines import engine

SCRAPE_TIMEOUT_S = 5.0
PROCESS_SAMPLES = ("process_cpu_seconds_total", "process_resident_memory_bytes")
# Histograms whose mean over a level is a summary column: column -> sample bases, first found wins.
ENGINE = engine()  # the engine seam: the names of its samples (decodescope.engines)
HISTOGRAM_MEANS = ENGINE.metrics.histogram_means
KV_USAGE = ENGINE.metrics.kv_usage   # a fraction, despite the name


def redact_secret(text: str, secret: Optional[str]) -> str:
    return text.replace(secret, "***") if secret else text



def _kept(name: str) -> bool:
    if ENGINE.is_own_metric(name):
        return not name.endswith(("_bucket", "_created"))
    return name in PROCESS_SAMPLES


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) of the samples kept (module docstring), from Prometheus text. Lines of
    other metrics are dropped before parsing, which keeps a scrape's cost to the samples kept."""
    lines = [ln for ln in text.splitlines()
             if ln and not ln.startswith("#") and _kept(ln.split("{", 1)[0].split(None, 1)[0])]
    if not lines:
        return []
    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families("\n".join(lines) + "\n") for s in fam.samples]


class Scraper:
    """GET <base_url>/metrics with the API key as a bearer token (as the requests send it); no proxies."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout_s: float = SCRAPE_TIMEOUT_S):
        self.url = base_url.rstrip("/") + "/metrics"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def scrape(self) -> tuple[float, float, Optional[list], Optional[str]]:
        """(t_s, seconds it took, samples or None, error or None); never raises."""
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
        return (t0 + t1) / 2, t1 - t0, None, redact_secret(err, self.api_key)[:500]


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
        if s0 is None or s1 is None or c0 is None or c1 is None:     # `None in (...)`, spelled so mypy narrows
            continue
        return (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return None


ENGINE_STEPS = ENGINE.metrics.engine_steps   # one observation per engine iteration (step)


def counter_delta(before: Optional[list], after: Optional[list], name: str) -> Optional[float]:
    """How much a counter (or a histogram's _count) grew between two scrapes; None when either
    scrape failed or the server does not expose it."""
    if not before or not after:
        return None
    a, b = _total(before, name), _total(after, name)
    return None if a is None or b is None else b - a

