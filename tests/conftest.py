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
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29731",
                    str(Path(__file__).parent / "make_cpu_traces.py"), str(out_dir), str(steps), str(per_step)],
                   check=True, env=env, capture_output=True, timeout=300)
    if gzip_them:
        for p in list(out_dir.glob("*.json")):
            with open(p, "rb") as src, gzip.open(str(p) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            p.unlink()
    return out_dir


@pytest.fixture(scope="session")
def cpu_traces(tmp_path_factory) -> Path:
    return make_cpu_traces(tmp_path_factory.mktemp("cpu_traces"))
