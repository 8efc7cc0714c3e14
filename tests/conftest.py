import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARAMS_DIR = REPO / "params"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing held a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    import tempfile

    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone: a free port, as make test's two lanes (tests/lanes.py) may each make their own traces at once
    # torchrun's own folder in one removed after it (without --log-dir it leaves a /tmp/torchelastic_* a launch)
    with tempfile.TemporaryDirectory(prefix="torchrun-") as logs:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        f"--log-dir={logs}", str(Path(__file__).parent / "make_cpu_traces.py"),
                        str(out_dir), str(steps), str(per_step)],
                       check=True, env=env, capture_output=True, timeout=300)
    if gzip_them:
        for p in list(out_dir.glob("*.json")):
            with open(p, "rb") as src, gzip.open(str(p) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            p.unlink()
    return out_dir


HANDOFF_ENV = "DECODESCOPE_TEST_HANDOFF"  # tests/lanes.py's directory for the session (its HANDOFF_ENV)


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


# ---- nothing of the suite left in /dev/shm (issue 55) ------------------------------------------------------
# Each test checks what its own runs made (by run token or run id); this checks, once the suite is over, that no
# test and nothing it started left a probe segment, a vLLM segment or a multiprocessing SharedMemory there. Files
# that were there when the suite began are not the suite's. Under tests/lanes.py the snapshot is the first lane's
# (kept in the lanes' handoff directory) and the check is made by the last lane of each stage to end, when no
# process of the suite is running; a file mapped by a live process outside the suite (another user's run on the
# same host) is that process's.
SHM_WATCHED = ("decodescope-probe-", "vllm_", "psm_")
SUITE_ENV = "DECODESCOPE_TEST_SUITE"  # on every process the suite starts here (not those sshd starts)
SHM_SETTLE_S = 20.0


def _shm_watched() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_WATCHED)}
    except OSError:
        return set()


def _shm_holders(names: set[str]) -> dict[str, list[int]]:
    """name -> live pids that map it or hold it open."""
    import psutil

    out: dict[str, list[int]] = {}
    for pid in psutil.pids():
        held: set[str] = set()
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                i = line.find("/dev/shm/")
                if i >= 0:
                    held.add(line[i + 9:].removesuffix(" (deleted)").strip())
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        held.add(target[9:].removesuffix(" (deleted)"))
        for n in held & names:
            out.setdefault(n, []).append(pid)
    return out


def _of_suite(pid: int, suite: str) -> bool:
    with contextlib.suppress(OSError):
        return f"\0{SUITE_ENV}={suite}\0".encode() in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    return False


def shm_left_by_suite(before: set[str], suite: str) -> dict[str, str]:
    """The watched /dev/shm files made since `before` that nothing outside the suite holds, each with why it is
    the suite's (no live holder, or the suite's pids that still hold it); polled for SHM_SETTLE_S, as a teardown
    of another run on the host may still be sweeping its own."""
    import time

    deadline = time.monotonic() + SHM_SETTLE_S
    while True:
        new = _shm_watched() - before
        holders = _shm_holders(new)
        left = {}
        for n in sorted(new):
            pids = holders.get(n, [])
            ours = [p for p in pids if _of_suite(p, suite)]
            if not pids:
                left[n] = "no live process holds it"
            elif ours:
                left[n] = f"still held by the suite's pids {ours}"
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def pytest_sessionstart(session):
    import uuid

    root = os.environ.get(HANDOFF_ENV)
    os.environ.setdefault(SUITE_ENV, root or uuid.uuid4().hex)
    session.config._shm_before = _shm_watched()
    if root:
        with _lanes_lock(Path(root)):
            first = Path(root) / "shm_before.json"
            if not first.exists():
                first.write_text(json.dumps(sorted(session.config._shm_before)))
            (Path(root) / f"lane-{os.getpid()}.running").touch()


@contextlib.contextmanager
def _lanes_lock(root: Path):
    import fcntl

    with open(root / "shm.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def pytest_sessionfinish(session, exitstatus):
    before: set[str] = getattr(session.config, "_shm_before", set())
    root = os.environ.get(HANDOFF_ENV)
    if root:
        with _lanes_lock(Path(root)):
            (Path(root) / f"lane-{os.getpid()}.running").unlink(missing_ok=True)
            others = [p for p in Path(root).glob("lane-*.running") if _pid_alive(int(p.name[5:-8]))]
            if others:  # another lane of this stage still runs: the last one to end checks
                return
            with contextlib.suppress(OSError, ValueError):
                before |= set(json.loads((Path(root) / "shm_before.json").read_text()))
    left = shm_left_by_suite(before, os.environ[SUITE_ENV])
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"/dev/shm files left by the suite ({len(left)}):"] + [f"  /dev/shm/{n}: {why}" for n, why in left.items()]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        else:
            print("\n".join(lines), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- the fault table's loaded rows (issue 55) --------------------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def _fault_load():
    """Under DECODESCOPE_FAULT_LOAD=1, the whole session beside one busy loop a core (tests/faultload.py
    busy_host), fixtures of every scope included: a fault injected in a module's fixture is injected loaded."""
    from tests.faultload import FAULT_LOAD_HERE, busy_host  # the standard library only until it starts loops

    with busy_host() if FAULT_LOAD_HERE else contextlib.nullcontext():
        yield


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
