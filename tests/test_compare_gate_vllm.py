"""`decodescope compare --gate` on real runs of the embedded default (real vLLM CPU server, TP=2): a variant
run eager (no torch.compile) is a real regression the gate fails on, naming the figure, the level and by how
much; a second run of the same settings passes. Serving only (00, 01), one level, three repeats a level: two
`decodescope run`s, three server starts (~4 minutes on two cores).

The gate, 15%: between two runs of these settings output throughput, E2E p50 and the server's TPOT mean moved
2-8%; the eager variant cost 30% of the throughput, 42% more E2E and 66% more server TPOT (2.8 -> 4.7 ms), each
band of the difference clear of 0 (2026-12-06, this machine). The client's TPOT and TTFT are not gated here:
on two cores the stream comes in bursts (docs/methods.md, "Stream delivery"; 90-100% of the gaps coalesced),
its TPOT p50 read 0.3 ms in one run and 0.8 ms in the next, and the gate says so rather than calling it."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_integration_vllm import _params

pytestmark = pytest.mark.integration
DECODESCOPE = [sys.executable, "-m", "decodescope.cli.main"]
GATE = "15"
PORT = 8793


def _run(params: Path, *extra: str, cwd: Path) -> Path:
    r = subprocess.run(DECODESCOPE + ["run", str(params), "--phases", "00_host", "01_serving", "--repeats", "3",
                                      *extra], capture_output=True, text=True, cwd=cwd, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(r.stdout.strip().splitlines()[-1]).parent


@pytest.fixture(scope="module")
def gate_runs(repo, tmp_path_factory, engine_allreduce) -> tuple[Path, Path]:
    """(a run with an eager variant, a second run of the same settings without it)."""
    if engine_allreduce.path == "gloo":
        # vLLM CPU 0.32 on its AVX2 build cannot serve eager at TP=2: each worker dies in the first decode step
        # (vocab_parallel_embedding: "IndexError: index out of range in self", 2026-12-06, fresh clone and by
        # hand); the slower setting this test needs is not one that engine runs on that path
        pytest.skip("vLLM CPU's AVX2 build dies serving enforce-eager at TP=2 (IndexError in the embedding)")
    tmp = tmp_path_factory.mktemp("gate")
    params = _params(repo, tmp, PORT, name="gate")
    text = params.read_text()
    for old, new in (("  concurrency: [1, 2, 4]\n", "  concurrency: [2]\n"),
                     ("  requests_per_level: 24\n", "  requests_per_level: 8\n")):
        assert text.count(old) == 1
        text = text.replace(old, new)
    params.write_text(text + "experiments:\n  - name: eager\n    engine_args: {enforce-eager: true}\n")
    first = _run(params, cwd=repo)
    second = _run(params, "--variants", "none", cwd=repo)
    return first, second


def _compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(DECODESCOPE + ["compare", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_an_eager_engine_fails_the_gate_naming_figure_level_and_amount(gate_runs, repo):
    first, _ = gate_runs
    r = _compare(str(first), f"{first}:eager", "--gate", GATE, cwd=repo)
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("REGRESSION: B against A: ")]
    assert lines and all("at concurrency 2:" in line and "% worse; 95% band of the difference [" in line
                         and f"gate {GATE}%" in line for line in lines)
    assert "regression" in r.stderr.splitlines()[-2] and "(exit status 1)" in r.stderr
    # the decode itself: the server's TPOT (vLLM's /metrics), whatever the delivery of the stream
    assert any("the server's TPOT mean (vLLM /metrics) at concurrency 2" in line for line in lines)
    result = json.loads(Path(r.stdout.strip()).with_suffix(".json").read_text())
    bad = [m for m in result["metrics"] if m["verdict"] == "regression"]
    assert result["exit_status"] == 1 and result["regressions"] == len(bad) == len(lines)
    for m in bad:  # worse beyond the gate, the band clear of 0 on the worse side
        assert m["worse_pct"] > float(GATE) and m["call"] == "significant" and m["n_a"] == m["n_b"] == 3
        assert (m["band_low"] > 0) if m["better"] == "lower" else (m["band_high"] < 0)
    assert {c["key"]: c["status"] for c in result["comparability"]} == {
        "model": "same", "tensor_parallel": "same", "engine_version": "same", "all_reduce": "same", "host": "same"}


def test_a_second_run_of_the_same_settings_passes_the_gate(gate_runs, repo):
    first, second = gate_runs
    r = _compare(str(first), str(second), "--gate", GATE, cwd=repo)
    assert r.returncode == 0, r.stderr
    assert "REGRESSION" not in r.stderr and re.search(r"gate: 0 regressions in [3-5] gated figures \(exit status 0\)",
                                                      r.stderr)
    result = json.loads(Path(r.stdout.strip()).with_suffix(".json").read_text())
    assert len(result["metrics"]) == 5 and all(m["n_a"] == m["n_b"] == 3 for m in result["metrics"])
    # and by name: the newest other run named `gate` is the first
    r = _compare("--baseline", "gate", str(second), "--gate", GATE, cwd=repo)
    assert r.returncode == 0 and f"baseline gate: {first}" in r.stderr
