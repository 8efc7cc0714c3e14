"""04's profiled window (profiling.window.profiled_window), which both the level captures and the
un-graphed capture go through, against a real HTTP server that answers vLLM's profiler endpoints as a server
with and without a profiler does: on /stop_profile it writes a real H200 rank trace (and the front end's)
into the trace directory before it answers, as vLLM's workers do."""
from __future__ import annotations

import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from decodescope.exec.server import VllmServer
from decodescope.serving.client import RequestRecord
from decodescope.profiling.window import CaptureError, profiled_window

H200_TRACES = Path(__file__).parent / "fixtures/traces/vllm_gpu_h200_kimi_int4_10l_host_ops"
PARAMS = SimpleNamespace(profile=SimpleNamespace(flush_timeout_s=20.0))


class ProfilerEndpoints:
    """/start_profile and /stop_profile answering `status[path]`; /health 200. A 200 /stop_profile first
    copies the fixture's traces into `trace_dir`."""

    def __init__(self, trace_dir: Path, status: dict[str, int]):
        self.calls: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                owner.calls.append(self.path)
                code = status.get(self.path, 404)
                if self.path == "/stop_profile" and code == 200:
                    for p in H200_TRACES.iterdir():
                        shutil.copy(p, trace_dir / p.name)
                self.send_response(code)
                self.end_headers()

            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def endpoints(tmp_path, request):
    ep = ProfilerEndpoints(tmp_path, request.param)
    yield ep
    ep.close()


def _one_request():
    return [RequestRecord(level=1, index=0, warmup=False, send_ns=1, first_chunk_ns=2, end_ns=3, n_out_usage=8)]


@pytest.mark.parametrize("endpoints", [{"/start_profile": 200, "/stop_profile": 200}], indirect=True)
def test_a_window_returns_the_ranks_traces_written_at_the_stop_and_the_workloads_records(endpoints, tmp_path):
    records_path = tmp_path / "data/profile_requests.parquet"
    records_path.parent.mkdir()

    def workload():
        assert endpoints.calls == ["/start_profile"]  # the workload runs inside the window
        return _one_request(), "extra"

    extra, fields = profiled_window(VllmServer(endpoints.url), PARAMS, tmp_path, 1, workload, "the workload",
                                    records_path)
    assert extra == "extra" and endpoints.calls == ["/start_profile", "/stop_profile"]
    assert [p.name for p in fields["rank_files"]] == [p.name for p in H200_TRACES.glob("dp0_*")]
    assert [p.name for p in fields["frontend_files"]] == [p.name for p in H200_TRACES.glob("*async_llm*")]
    assert fields["problems"] == [] and fields["requests_ok"] == 1 and fields["requests_failed"] == 0
    assert pd.read_parquet(records_path)["n_out_usage"].tolist() == [8]


@pytest.mark.parametrize("endpoints", [{}], indirect=True)
def test_a_server_without_a_profiler_is_named_before_the_workload_runs(endpoints, tmp_path):
    ran = []
    with pytest.raises(CaptureError, match=r"/start_profile answered HTTP 404: the server has no profiler "
                                           r"configured. Start it with --profiler-config") as err:
        profiled_window(VllmServer(endpoints.url), PARAMS, tmp_path, 1, lambda: ran.append(1) or ([], None),
                        "the workload")
    assert endpoints.url in str(err.value) and ran == [] and endpoints.calls == ["/start_profile"]


@pytest.mark.parametrize("endpoints", [{"/start_profile": 200, "/stop_profile": 500}], indirect=True)
def test_a_failed_stop_is_an_error_and_the_records_are_already_written(endpoints, tmp_path):
    records_path = tmp_path / "profile_requests.parquet"
    with pytest.raises(CaptureError, match="/stop_profile answered HTTP 500 after"):
        profiled_window(VllmServer(endpoints.url), PARAMS, tmp_path, 1, lambda: (_one_request(), None),
                        "the workload", records_path)
    assert len(pd.read_parquet(records_path)) == 1
