import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARAMS_DIR = REPO / "params"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
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
