import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARAMS_DIR = REPO / "params"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture
def write_params(tmp_path):
    """Write a params file next to a copy of params/models so relative model paths resolve."""
    import shutil

    models = tmp_path / "models"
    if not models.exists():
        shutil.copytree(PARAMS_DIR / "models", models)

    def _write(text: str, name: str = "p.yaml") -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p
    return _write


def make_cpu_traces(out_dir: Path, steps: int = 5, per_step: int = 3, gzip_them: bool = True) -> Path:
    """Real torch.profiler traces from two torchrun ranks (gloo)."""
    import gzip
    import shutil
    import subprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: a free port, as make test's two lanes (tests/lanes.py) may each make their own traces at once
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                    str(Path(__file__).parent / "make_cpu_traces.py"), str(out_dir), str(steps), str(per_step)],
                   check=True, env=env, capture_output=True, timeout=300)
    if gzip_them:
        for p in list(out_dir.glob("*.json")):
            with open(p, "rb") as src, gzip.open(str(p) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            p.unlink()
    return out_dir


class Handoff:
    """What a fixture of make test's first stage hands to a test of its second (tests/lanes.py LATE), as JSON
    in the directory that tests/lanes.py names in DECODESCOPE_TEST_HANDOFF; without that directory (pytest
    run by hand) nothing is handed over and the test makes the fixture itself."""

    def __init__(self, root: Path | None):
        self.root = root

    def load(self, name: str) -> dict | None:
        path = self.root / f"{name}.json" if self.root else None
        return json.loads(path.read_text()) if path and path.is_file() else None

    def save(self, name: str, value: dict) -> None:
        if self.root:
            tmp = self.root / f".{name}.json.tmp"
            tmp.write_text(json.dumps(value, default=str))
            tmp.replace(self.root / f"{name}.json")


@pytest.fixture(scope="session")
def handoff() -> Handoff:
    root = os.environ.get("DECODESCOPE_TEST_HANDOFF")
    return Handoff(Path(root) if root else None)


@pytest.fixture(scope="session")
def e2e_run(repo, tmp_path_factory) -> dict:
    """The embedded default run end to end once per session (secrets and markup planted in its inputs):
    read by test_integration_vllm and, as the local run to compare with, by test_integration_ssh."""
    from tests.test_integration_vllm import run_e2e

    return run_e2e(repo, tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def cpu_traces(tmp_path_factory) -> Path:
    return make_cpu_traces(tmp_path_factory.mktemp("cpu_traces"))


# ---- which vLLM CPU path the tests run on (issue 25): the host's own, or AVX2 forced on any x86 host ----
def pytest_addoption(parser):
    parser.addoption("--cpu-path", choices=("native", "avx2"), default=os.environ.get("DECODESCOPE_CPU_PATH") or "native",
                     help="native: vLLM CPU as this host loads it; avx2: every process the tests start sees no "
                          "AVX-512/AMX (decodescope.exec.engine_comm's sitecustomize), so vLLM loads _C_AVX2 and "
                          "all-reduces through gloo. Default: $DECODESCOPE_CPU_PATH, else native")


def pytest_configure(config):
    # the standard library only: GPU tests run on an image without decodescope's dependencies
    from decodescope.core.cpupath import apply_cpu_path_here

    config.addinivalue_line("markers", "torchrun: uses real torchrun ranks (the cpu_traces fixture); "
                                       "`make test-fast` leaves them out")

    # into os.environ (every server, probe and run inherits it) and into this process, which loads vLLM's
    # kernels itself in some tests
    apply_cpu_path_here(config.getoption("--cpu-path"))


def _engine_allreduce_here():
    """The all-reduce path a process started by the tests finds, found there as vLLM finds it."""
    import subprocess

    from decodescope.schema.records_host import EngineAllReduce

    code = ("from decodescope.exec.engine_comm import engine_allreduce; "
            "print(engine_allreduce(has_gpu=False).model_dump_json())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return EngineAllReduce.model_validate_json(r.stdout.strip().splitlines()[-1])


def pytest_report_header(config):
    return f"cpu path: {config.getoption('--cpu-path')} (decodescope.exec.engine_comm; --cpu-path=avx2 forces vLLM CPU's AVX2 path)"


@pytest.fixture(scope="session")
def engine_allreduce():
    """The host's vLLM all-reduce path under this session's --cpu-path: what a test that names the engine's
    communicator asserts (vllm_shm where vLLM CPU loads _C/_C_AVX512, torch_gloo where it loads _C_AVX2)."""
    return _engine_allreduce_here()


def pytest_collection_modifyitems(config, items):
    for item in items:  # the real two-rank traces come from torchrun: not for `make test-fast`
        if "cpu_traces" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.torchrun)
