"""The attach guard's parts: the server's profiler read from its command line, the probes' model on
hand-worked numbers, a window's plan (fits, shrunk, refused), the server read through the host seam, and
an attached server's traces copied in on this host."""
from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from decodescope.exec.attached import AttachError, TreeWatch, check_attached, read_server
from decodescope.exec.host import node_traces
from decodescope.exec.hostcore import LocalHost
from decodescope.exec.servertree import profiler_settings
from decodescope.schema.params import load_params
from decodescope.schema.records_attach import WindowCost
from decodescope.profiling.attachguard import (EXPORT_PER_TRACE_BYTE, MEMORY_SHARE, SLICE_MAX_S,
                                           STACK_WINDOW_EXPORT_BYTES, bytes_per_step, export_ratio, plan_window,
                                           pricing_window, saw_steps, slice_seconds, stack_refusal, window_span_s,
                                           window_steps)

REPO = Path(__file__).resolve().parents[1]
MiB, GiB = 2**20, 2**30


# ---- the server's profiler, from its command line ---------------------------------------------------------
@pytest.mark.parametrize("argv, directory, stack", [
    (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/t"}'], "/t", True),
    (['--profiler-config={"profiler":"torch","torch_profiler_dir":"/t","torch_profiler_with_stack":false}'], "/t", False),
    (["--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_dir=/t",
      "--profiler-config.torch_profiler_with_stack=false"], "/t", False),
])
def test_the_profiler_flag_is_read_in_each_form_vllm_accepts(argv, directory, stack):
    got = profiler_settings(["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "1", *argv])
    assert got["configured"] is True and got["torch_profiler_dir"] == directory
    assert got["torch_profiler_with_stack"] is stack


def test_a_server_without_the_flag_has_no_profiler_and_the_old_variables_still_count():
    assert profiler_settings(["python", "-m", "vllm.entrypoints.openai.api_server"])["configured"] is False
    old = profiler_settings(["vllm"], {"VLLM_TORCH_PROFILER_DIR": "/t", "VLLM_TORCH_PROFILER_WITH_STACK": "0"})
    assert old["configured"] and old["torch_profiler_dir"] == "/t" and old["torch_profiler_with_stack"] is False


# ---- the guard's arithmetic, on hand-worked numbers --------------------------------------------------------
def _cost(label, tokens, span_s, trace, export=None):
    """A window that generated `tokens` output tokens in as many engine steps (one request at a time)."""
    return WindowCost(label=label, requests=1, steps=tokens, tokens=tokens, span_s=span_s, trace_bytes=trace,
                      export_bytes=export, window_s=1.0)


def test_the_export_ratio_is_the_largest_measured_and_never_below_the_floor():
    # 2 ranks x 100 KB of trace, 60 MB of export over the processes: 300 a byte
    assert export_ratio([_cost("a", 1, 0.1, 100_000, 60_000_000), _cost("b", 1, 0.1, 100_000, 0)], ranks=2) == 300
    assert export_ratio([_cost("a", 1, 0.1, 100_000, 0)], ranks=2) == EXPORT_PER_TRACE_BYTE   # no growth seen


def test_a_slice_is_as_long_as_the_probe_read_most_pessimistically_allows():
    probe = _cost("probe-1", 1, 0.1, 2 * MiB)          # 20 MiB a second of span
    # 20 MiB/s x 175 x 2 ranks = 6.84 GiB/s of export; 10% of 20 GiB = 2 GiB -> 0.29 s
    assert slice_seconds(probe, 2, 20 * GiB, 175.0) == pytest.approx(2 * GiB / (20 * MiB * 175 * 2))
    assert slice_seconds(probe, 2, 4 * GiB, 175.0) == 0.0             # not even SLICE_MIN_S: nothing profiled
    assert slice_seconds(_cost("p", 1, 0.1, 8_000), 2, 20 * GiB, EXPORT_PER_TRACE_BYTE) == SLICE_MAX_S


# a slice of 2 s that generated 100 tokens and wrote 2 MiB a rank: 50 tokens and 1 MiB per second of span
FAST = _cost("slice-c1", 100, 2.0, 2 * MiB)
# the same bytes per second at 5 tokens a second (stacks on: each step slowed by the tracer)
SLOW = _cost("slice-c1", 10, 2.0, 2 * MiB)


def test_a_server_with_stacks_on_is_refused_before_any_window_unless_its_host_holds_the_smallest():
    assert stack_refusal(False, 8, 10 * GiB) is None and stack_refusal(None, 8, 10 * GiB) is None
    why = stack_refusal(True, 2, 20 * GiB)          # 2 x 11.5 GB against 50% of 20 GiB
    assert "torch_profiler_with_stack false" in why and "No profile was started" in why
    assert stack_refusal(True, 2, 2 * STACK_WINDOW_EXPORT_BYTES / MEMORY_SHARE) is None   # a host that holds it


def test_a_window_that_fits_runs_whole():
    plan = plan_window("c1", FAST, 12, 192, 1, ranks=2, ratio=100.0, mem_available=20 * GiB, disk_free=100 * GiB)
    # by the span: 192 tokens / 50 a second = 3.84 s -> 3.84 MiB a rank; by the step: 2 MiB / 100 steps x
    # (192 + 12) steps = 4.08 MiB, the larger; 2 x 100 x 4.08 MiB = 816 MiB of export
    assert plan.decision == "fits" and plan.allowed_requests == 12
    assert plan.est_span_s == pytest.approx(3.84) and window_span_s(FAST, 192) == pytest.approx(3.84)
    assert plan.est_steps == 204 and plan.est_trace_bytes == int(2 * MiB / 100 * 204)
    assert plan.est_export_bytes == int(2 * MiB / 100 * 204 * 100 * 2)


def test_a_window_is_priced_at_its_most_steps_whatever_pace_its_slice_ran_at():
    # a slice at concurrency 4 whose batches were full: 100 tokens in 25 steps, 2 MiB. Its window may take
    # four times as many steps (its requests one by one, as a stalled client runs them): by the span it
    # would read 3.84 MiB, by the step 2 MiB / 25 x 204 = 16.32 MiB
    batched = WindowCost(label="slice-c4", requests=12, steps=25, tokens=100, span_s=2.0, trace_bytes=2 * MiB,
                         window_s=1.0)
    plan = plan_window("c4", batched, 12, 192, 4, ranks=2, ratio=100.0, mem_available=20 * GiB, disk_free=None)
    assert plan.est_steps == 204 and plan.est_trace_bytes == int(2 * MiB / 25 * 204)
    assert bytes_per_step(batched) == 2 * MiB / 25 and window_steps(12, 192) == 204
    # the steps annotated in the trace, where counted, over vLLM's counter (whose span can miss a step or two)
    counted = batched.model_copy(update={"trace_steps": 32})
    assert bytes_per_step(counted) == 2 * MiB / 32
    assert plan_window("c4", counted, 12, 192, 4, 2, 100.0, 20 * GiB, None).est_trace_bytes == int(2 * MiB / 32 * 204)
    # shrunk (0.5 x 16 GiB / (300 x 2) = 13.65 MiB of 16.32: 10 of 12 requests), its steps shrink with them
    tight = plan_window("c4", batched, 12, 192, 4, ranks=2, ratio=300.0, mem_available=16 * GiB, disk_free=None)
    assert tight.allowed_requests == 10 and tight.est_steps == pytest.approx(170.0)


def test_a_slice_that_saw_no_step_prices_nothing_and_the_most_bytes_a_step_measured_prices_the_window():
    # CI's servers lane: the c4 slice started after its 12 requests of 16 tokens had ended: 814 bytes, no
    # step, no token in 0.126 s. Priced from it, c4's window read 166 KB and then wrote 325 KB. The windows
    # measured before it: probe-1 (7,713 B over 2 steps) and c1's slice (1,094,771 B over 187 steps)
    empty = WindowCost(label="slice-c4", requests=12, steps=0.0, trace_steps=0, tokens=0.0, span_s=0.126,
                       trace_bytes=814, window_s=4.26)
    probe = WindowCost(label="probe-1", requests=1, steps=1.0, trace_steps=2, tokens=1.0, span_s=0.0235,
                       trace_bytes=7713, window_s=4.1)
    c1 = WindowCost(label="slice-c1", requests=12, steps=176.0, trace_steps=187, tokens=176.0, span_s=1.38,
                    trace_bytes=1_094_771, window_s=8.7)
    assert not saw_steps(empty) and saw_steps(probe) and saw_steps(c1)
    assert pricing_window(empty, [probe, c1, empty]) is c1  # 5,854 bytes a step against probe-1's 3,857
    assert pricing_window(c1, [probe, empty]) is c1  # a slice that saw steps prices its own level
    assert pricing_window(empty, [empty]) is empty  # nothing better measured: the slice, as before
    plan = plan_window("c4", pricing_window(empty, [probe, c1, empty]), 12, 192, 4, ranks=2, ratio=134.0,
                       mem_available=20 * GiB, disk_free=None)
    # by the step 1,094,771 / 187 x 204 = 1,194,295 B; by the span 192 tokens at c1's 127.5 a second,
    # 1.506 s at 793,312 B a second, about as much: c1's 1.19 MB, against the 325 KB c4 then wrote
    assert plan.priced_by == "slice-c1" and plan.est_trace_bytes == int(1_094_771 / 187 * 204)


def test_a_window_too_large_is_shrunk_to_the_requests_that_fit():
    # 192 tokens at 5 a second = 38.4 s -> 38.4 MiB a rank; memory allows 0.5 x 20 GiB / (300 x 2) = 17.07 MiB
    plan = plan_window("c1", SLOW, 12, 192, 1, ranks=2, ratio=300.0, mem_available=20 * GiB, disk_free=100 * GiB)
    assert plan.allowed_requests == 5 and plan.decision.startswith("shrunk") and "memory" in plan.decision
    assert plan.est_export_bytes <= MEMORY_SHARE * 20 * GiB


def test_a_window_whose_one_batch_does_not_fit_is_refused():
    plan = plan_window("c8", SLOW, 12, 192, 8, ranks=2, ratio=300.0, mem_available=20 * GiB, disk_free=100 * GiB)
    assert plan.allowed_requests == 0 and plan.decision.startswith("refused: one batch of 8")
    # disk: 50% of 15 MiB over 2 ranks and the front end = 2.5 MiB a trace, against 3.84 MiB for 12 requests
    disk = plan_window("c1", FAST, 12, 192, 1, ranks=2, ratio=100.0, mem_available=None, disk_free=15 * MiB)
    assert disk.allowed_requests == 7 and "disk" in disk.decision
    assert plan_window("c8", FAST, 12, 192, 8, 2, 100.0, None, 15 * MiB).allowed_requests == 0


# ---- the server read on its host, never signalled -----------------------------------------------------------
@pytest.fixture
def listener(tmp_path):
    """A process listening on a port, with the profiler flag on its command line and a child of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import socket, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
            "print('ready', flush=True)\nblob = []\n"
            "for _ in range(20):\n    blob.append(bytearray(8 << 20)); time.sleep(0.05)\n"
            "time.sleep(600)\n")
    flag = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "t")})
    proc = subprocess.Popen([sys.executable, "-c", code, str(port), "--profiler-config", flag], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    yield port, proc
    subprocess.run(["pkill", "-KILL", "-g", str(proc.pid)])
    proc.wait()


def test_the_server_is_read_through_the_host_seam_with_its_tree_and_memory(listener):
    port, proc = listener
    host = LocalHost()
    with TreeWatch(host, port, timeout_s=60) as watch:
        time.sleep(1.5)   # the listener allocates 160 MiB over its first second
    reading = watch.reading
    assert reading["pid"] == proc.pid and len(reading["pids"]) == 2 and reading["profiler"]["configured"] is True
    grew = reading["rss_peak_bytes"][str(proc.pid)] - reading["rss_start_bytes"][str(proc.pid)]
    assert grew > 64 * MiB
    assert reading["alive_at_end"] and proc.poll() is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]   # bound, not listening
        assert read_server(host, nobody)["pid"] is None


def _attach_params(tmp_path, url: str, trace_dir: str | None):
    text = (REPO / "params/default.yaml").read_text().replace("  mode: launch\n", f"  mode: attach\n  url: {url}\n")
    text = text.replace("config: models/", f"config: {REPO / 'params/models'}/")
    text = text.replace("host: local\n", "host:\n  url: local\n" + (f"  trace_dir: {trace_dir}\n" if trace_dir else ""))
    p = tmp_path / "attach.yaml"
    p.write_text(text)
    return load_params(p)


def test_the_preflight_names_a_trace_dir_other_than_the_servers_own(listener, tmp_path):
    port, _ = listener
    params = _attach_params(tmp_path, f"http://127.0.0.1:{port}", "/somewhere/else")
    with pytest.raises(AttachError) as e:
        check_attached(params, LocalHost(), ["04_profile"])
    assert "host.trace_dir is '/somewhere/else'" in str(e.value) and str(tmp_path / "t") in str(e.value)
    ok = check_attached(_attach_params(tmp_path, f"http://127.0.0.1:{port}", None), LocalHost(), ["04_profile"])
    assert ok["profiler"]["torch_profiler_dir"] == str(tmp_path / "t")
    assert check_attached(params, LocalHost(), ["01_serving"]) == {}   # no profile, nothing to check


def test_the_preflight_asks_for_host_trace_dir_when_the_server_cannot_be_read(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # nothing listens there
    with pytest.raises(AttachError) as e:
        check_attached(_attach_params(tmp_path, f"http://127.0.0.1:{port}", None), LocalHost(), ["04_profile"])
    assert "host.trace_dir is not set" in str(e.value) and "torch_profiler_dir" in str(e.value)


# ---- an attached server's traces on this host -----------------------------------------------------------------
def test_an_attached_servers_traces_here_are_copied_in_whole_and_stay_where_they_are_filed(tmp_path):
    theirs = tmp_path / "their-traces"
    theirs.mkdir()
    whole = gzip.compress(b'{"traceEvents": []}' * 5000)
    (theirs / "old.pt.trace.json.gz").write_bytes(whole)          # before this run: not ours
    params = _attach_params(tmp_path, "http://127.0.0.1:9", str(theirs))
    params = params.model_copy(update={"host": params.host.model_copy(update={"sync_interval_s": 0.1})})
    trace_dir = tmp_path / "run" / "traces"
    partial = []
    with node_traces(params, trace_dir):
        (theirs / "rank0.pt.trace.json.gz").write_bytes(whole[:100])
        for _ in range(10):
            time.sleep(0.05)
            partial += list(trace_dir.rglob("rank0*"))
        (theirs / "rank0.pt.trace.json.gz").write_bytes(whole)
        got = trace_dir / "node0" / "rank0.pt.trace.json.gz"
        deadline = time.monotonic() + 20
        while not got.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got.read_bytes() == whole
        (trace_dir / "c1").mkdir()
        got.rename(trace_dir / "c1" / got.name)
    assert partial == [] and not list(trace_dir.rglob("old*"))
    assert not got.exists() and (trace_dir / "c1" / got.name).read_bytes() == whole  # the last sync did not bring it back
    assert (theirs / "rank0.pt.trace.json.gz").is_file()     # the user's own copy stays theirs
    assert not (tmp_path / "run" / ".trace_sync").exists()

