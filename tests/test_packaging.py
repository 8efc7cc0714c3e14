import os
import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from decodescope.trace.breakdown_file import BreakdownFile


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req.strip(), maxsplit=1)[0].lower()


def test_environment_yml_and_pyproject_list_the_same_packages(repo):
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    wanted = {_name(r): r for r in project["dependencies"]}
    for extra in ("cpu", "dev"):
        wanted.update({_name(r): r for r in project["optional-dependencies"][extra]})
    env = yaml.safe_load((repo / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {_name(r): r for r in pip_section if not r.startswith("-e")}
    assert set(listed) == set(wanted)
    for name, req in wanted.items():
        assert listed[name].replace(" ", "") == req.replace(" ", ""), name


def test_required_layout_exists(repo):
    for path in ("notebooks", "lib/decodescope", "params/default.yaml", "environment.yml", "README.md",
                 "docs/DESIGN.md", "outputs", ".ci/run", "Makefile"):
        assert (repo / path).exists(), path


def test_ci_runs_make_test(repo):
    assert "make test" in (repo / ".ci/run").read_text()


def test_notebooks_are_committed_without_outputs_and_with_parameters_cell(repo):
    import nbformat

    from decodescope.schema.params import PHASES

    for nb_path in sorted((repo / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, nb_path.name
        if nb_path.stem in PHASES:
            assert "params_path" in tagged[0].source and "run_dir" in tagged[0].source
        else:  # 06_compare: not a phase, it reads run directories
            assert "runs =" in tagged[0].source and "out =" in tagged[0].source, nb_path.name
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs, f"{nb_path.name} has outputs committed"


# ---- the installed package: notebooks, params templates and category rules ship inside it -----------
def _synthetic_cpu_traces(out: Path, ranks: int = 2, steps: int = 4) -> Path:
    """Per-rank Kineto JSON shaped like vLLM's CPU build: annotated decode steps holding a matmul, a gloo
    all-reduce and an add (the analysis needs only these fields)."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        events = []
        for s in range(steps):
            t0 = 1000.0 + 1000.0 * s
            for cat, name, ts, dur in (("user_annotation", "execute_context_0(0)_generation_2(2)", t0, 400.0),
                                       ("cpu_op", "aten::mm", t0 + 10, 100.0),
                                       ("cpu_op", "gloo:all_reduce", t0 + 120, 150.0 + 10 * rank),
                                       ("cpu_op", "aten::add", t0 + 300, 20.0)):
                events.append({"ph": "X", "cat": cat, "name": name, "pid": 100 + rank, "tid": 1, "ts": ts,
                               "dur": dur, "args": {"External id": len(events)}})
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": ranks},
               "traceEvents": events, "traceName": f"host_rank{rank}.json"}
        (out / f"host_rank{rank}.{1000 + rank}.pt.trace.json").write_text(json.dumps(doc))
    return out


def _run(argv, env=None, **kw):
    import subprocess

    env = {k: v for k, v in (env or os.environ).items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, env=env, **kw)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def source_copy(repo: Path, src: Path) -> Path:
    """The files a wheel is built from, copied: an in-tree build writes build/ and egg-info into a tree
    others edit meanwhile. The copy keeps lib/decodescope/_data's relative symlinks pointing at the copied
    notebooks/ and params/."""
    import shutil

    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(repo / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for name in ("notebooks", "params"):
        shutil.copytree(repo / name, src / name, ignore=ignore)
    shutil.copytree(repo / "lib" / "decodescope", src / "lib" / "decodescope", symlinks=True, ignore=ignore)
    return src


@pytest.mark.integration  # a wheel built and installed by pip: make test, not test-fast
def test_wheel_installed_outside_the_repo_finds_its_notebooks_params_and_rules(repo, tmp_path):
    """Build a wheel (offline, no build isolation), install it NON-editable into a fresh venv that sees this
    venv's dependencies but not lib/, and use it from a directory outside the repository."""
    import json
    import shutil
    import sysconfig

    src = source_copy(repo, tmp_path / "src")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", dist, src])
    wheel = next(dist.glob("decodescope-*.whl"))

    # A fresh venv; pip runs from here against its interpreter (--python), so it installs into that venv
    # only. Afterwards a .pth puts this venv's site-packages (pandas, pydantic, ...) behind it: a plain
    # path, so the editable install's own .pth there (which adds lib/) is not processed.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    vpy = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", vpy, "install", "--no-deps", "--no-index", "-q", wheel])
    site = Path(_run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "_decodescope_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = json.loads(_run([vpy, "-c", "import json, decodescope.orchestration.phasenotebooks as r, decodescope.orchestration.runmanifest as m, "
                                        "decodescope.trace.categorize as c; "
                                        "print(json.dumps([r.__file__, str(r.NOTEBOOK_DIR), r.available_phases(), "
                                        "str(c.DEFAULT_RULES), m.REPO_ROOT]))"], cwd=outside).stdout)
    module, notebooks, phases, rules, repo_root = where
    for path in (module, notebooks, rules):
        # the wheel's copies, not the repository's files
        assert Path(path).resolve().is_relative_to(site.resolve()), path
    assert phases == ["00_host", "01_serving", "02_gemm", "03_collectives", "04_profile", "05_verdict"]
    assert repo_root is None

    # the README's first step from a wheel: a shipped template with its models/, then validate it
    for name in ("default", "kimi-k2.5-int4-8x-pcie"):
        proc = _run([venv / "bin" / "decodescope", "params", "init", name, "params"], cwd=outside)
        assert proc.stdout.strip().endswith(f"params/{name}.yaml")
        proc = _run([venv / "bin" / "decodescope", "params", "validate", f"params/{name}.yaml"], cwd=outside)
        assert ": ok (run name" in proc.stdout and "warning" not in proc.stderr

    _synthetic_cpu_traces(outside / "traces")
    proc = _run([venv / "bin" / "decodescope", "analyze-trace", "traces", "--out", "analysis",
                 "--model-config", "params/models/tiny-qwen3-moe.json", "--tp", "2"], cwd=outside)
    summary = json.loads((outside / "analysis" / "profile_summary.json").read_text())
    assert summary["ranks"] == [0, 1] and summary["steps"] == {"decode": 8}
    # the category rules shipped in the wheel put gloo's all-reduce where the repository's rules do
    assert summary["allreduce_calls_per_step"] == {"0": 1.0, "1": 1.0}, proc.stdout
    # the streamed breakdown reduces Kineto's layout in C, its library built from the wheel's own source,
    # in a cache of its own
    shutil.copytree(repo / "tests/fixtures/traces/h200x2_step_replay_graph", outside / "gpu_traces")
    env_cache = {"XDG_CACHE_HOME": str(outside / "cache")}
    proc = _run([venv / "bin" / "decodescope", "analyze-trace", "gpu_traces", "--breakdown", "--out", "analysis"],
                cwd=outside, env={**os.environ, **env_cache})
    breakdown = BreakdownFile.read(outside / "analysis" / "breakdown.json")
    assert breakdown.ranks == [0, 1] and set(breakdown.chunks_by_reader) == {"c_reduce"}, breakdown
    assert breakdown.chunks_by_reader["c_reduce"] > 0 and list((outside / "cache" / "decodescope").glob("kscan-*.so"))


def test_the_readme_is_read_in_minutes_and_its_links_resolve(repo):
    text = (repo / "README.md").read_text()
    assert len(text.split()) <= 2200, "the README is for a newcomer: methods and results go to docs/"
    assert "make run" in text and "make test" in text
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((repo / link).exists() for link in links), [l for l in links if not (repo / l).exists()]
    for doc, heading in (("docs/methods.md", "## The ssh host"), ("docs/methods.md", "## Analysing traces alone"),
                         ("docs/faults.md", "<!-- fault-table:start -->"), ("docs/results.md", "## Benchmarks")):
        assert heading in (repo / doc).read_text(), (doc, heading)
