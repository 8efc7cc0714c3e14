"""A GPU host without a package index: decodescope's wheelhouse, built here with pip, installed there with
`pip install --no-index --find-links` (decodescope.exec.wheelhouse, `decodescope wheelhouse`)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from decodescope.exec import wheelhouse as wh
from tests.test_packaging import _run, _synthetic_cpu_traces, source_copy


def test_host_packages_are_read_from_a_freeze_with_and_without_versions(tmp_path):
    freeze = tmp_path / "host.txt"
    freeze.write_text("# the host's pip list --format=freeze\nTorch==2.11.0\nnvidia_ml_py==13.580.82\n"
                      "typing-extensions\nmylib @ file:///opt/mylib\n\n")
    have = wh.read_host_packages(freeze)
    assert have == {"torch": "2.11.0", "nvidia-ml-py": "13.580.82", "typing-extensions": None, "mylib": None}
    # only exact versions become constraints
    assert wh.constraints_text(have) == "nvidia-ml-py==13.580.82\ntorch==2.11.0\n"


def test_a_host_line_with_a_range_is_refused_naming_the_file_and_line(tmp_path):
    freeze = tmp_path / "host.txt"
    freeze.write_text("torch==2.11.0\npandas>=2\n")
    with pytest.raises(wh.WheelhouseError, match=r"host.txt:2: 'pandas>=2'.*name==1.2.3"):
        wh.read_host_packages(freeze)


def test_what_the_host_has_or_a_bundle_brings_is_left_out_of_the_downloads():
    report = {"install": [
        {"metadata": {"name": "papermill", "version": "2.7.0"}, "download_info": {"url": "https://x/papermill.whl"}},
        {"metadata": {"name": "Torch", "version": "2.11.0"}, "download_info": {"url": "https://x/torch.whl"}},
        {"metadata": {"name": "vllm", "version": "0.26.0"}, "download_info": {"url": "https://x/vllm.whl"}},
        {"metadata": {"name": "decodescope", "version": "0.1.0"}, "download_info": {"url": "file:///w/d.whl"}},
        {"metadata": {"name": "nbconvert", "version": "7.17.2"}, "download_info": {"url": "file:///opt/nb.whl"}},
    ]}
    got = wh.to_download(report, have={"torch": "2.11.0"}, skip={"vllm", "decodescope"})
    assert got == [("nbconvert", "7.17.2"), ("papermill", "2.7.0")]


def test_a_target_interpreter_is_passed_to_pip_as_binary_only_tags():
    t = wh.Target(python_version="3.12", platforms=("manylinux_2_28_x86_64", "manylinux2014_x86_64"))
    assert t.pip_args() == ["--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12",
                            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64"]
    assert wh.Target().pip_args() == ["--only-binary=:all:"]
    assert "manylinux_2_39_x86_64" in wh.MANYLINUX_X86_64 and "manylinux_2_17_x86_64" in wh.MANYLINUX_X86_64


def test_the_cli_refuses_a_source_tree_without_pyproject(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "wheelhouse", str(tmp_path / "wh"),
                           "--project", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "has no pyproject.toml" in proc.stderr


@pytest.mark.integration
def test_a_fresh_venv_installs_from_the_wheelhouse_with_no_index_and_runs_a_phase(repo, tmp_path):
    """Built here with the package index; installed into a fresh venv with --no-index from outside the
    repository; then the README's first steps, analyze-trace and one papermill phase (00_host)."""
    src = source_copy(repo, tmp_path / "src")
    house = tmp_path / "wheelhouse"
    build = subprocess.run([sys.executable, "-m", "decodescope.cli.main", "wheelhouse", str(house), "--project", str(src)],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    made = json.loads((house / "wheelhouse.json").read_text())
    names = {d.split("==")[0] for d in made["downloaded"]}
    assert {"papermill", "nbconvert", "plotly", "pandas", "pydantic", "ipykernel"} <= names
    assert "torch" not in names and "vllm" not in names  # core only: the host brings its own

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    vpip = [venv / "bin" / "python", "-m", "pip"]
    _run([*vpip, "install", "-q", "--no-index", "--find-links", house, "decodescope"])
    assert (venv / "bin" / "decodescope").exists()

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    ds = venv / "bin" / "decodescope"
    proc = _run([ds, "params", "init", "default", "params"], cwd=outside)
    assert proc.stdout.strip().endswith("params/default.yaml")
    proc = _run([ds, "params", "validate", "params/default.yaml"], cwd=outside)
    assert ": ok (run name" in proc.stdout
    _synthetic_cpu_traces(outside / "traces")
    _run([ds, "analyze-trace", "traces", "--out", "analysis", "--model-config", "params/models/tiny-qwen3-moe.json",
          "--tp", "2"], cwd=outside)
    summary = json.loads((outside / "analysis" / "profile_summary.json").read_text())
    assert summary["ranks"] == [0, 1] and summary["steps"] == {"decode": 8}

    proc = _run([ds, "run", "params/default.yaml", "--phases", "00_host"], cwd=outside)
    run_dir = Path(proc.stdout.strip().splitlines()[-1]).parent
    manifest = json.loads((outside / run_dir / "manifest.json").read_text())
    assert manifest["phases"]["00_host"]["status"] == "ok", manifest["phases"]
    host = json.loads((outside / run_dir / "data" / "host.json").read_text())
    assert host["has_gpu"] is False and host["cpu"]["logical_cores"] >= 1
    assert (outside / run_dir / "report.html").stat().st_size > 10_000


@pytest.mark.integration
def test_decodescopes_wheel_builds_from_a_python_whose_setuptools_has_no_bdist_wheel(repo, tmp_path):
    """A fresh venv (ensurepip's setuptools, no `wheel`: `setup.py bdist_wheel` is not a command there) builds
    decodescope's wheel in pip's isolated build environment instead of failing with "invalid command
    'bdist_wheel'"; the wheel carries the notebooks and the C scanner's source."""
    import zipfile

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    py = str(venv / "bin" / "python")
    code = ("import sys; from pathlib import Path; from decodescope.exec.wheelhouse import build_wheel, local_build_gap\n"
            "print(local_build_gap()); print(build_wheel(Path(sys.argv[1]), Path(sys.argv[2])))\n")
    src = source_copy(repo, tmp_path / "src")
    proc = subprocess.run([py, "-c", code, str(src), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(src / "lib"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    gap, wheel = proc.stdout.strip().splitlines()[-2:]
    assert "without the wheel package" in gap or gap.startswith("no setuptools"), gap
    names = zipfile.ZipFile(wheel).namelist()
    assert "decodescope/trace/_kscan.c" in names and "decodescope/_data/notebooks/05_verdict.ipynb" in names
