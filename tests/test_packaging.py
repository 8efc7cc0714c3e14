import re
import tomllib

import yaml


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
                 "outputs", ".ci/run", "Makefile"):
        assert (repo / path).exists(), path


def test_ci_runs_make_test(repo):
    assert "make test" in (repo / ".ci/run").read_text()


def test_notebooks_are_committed_without_outputs_and_with_parameters_cell(repo):
    import nbformat

    for nb_path in sorted((repo / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, nb_path.name
        assert "params_path" in tagged[0].source and "run_dir" in tagged[0].source
        for c in nb.cells:
            if c.cell_type == "code":
                assert not c.outputs, f"{nb_path.name} has outputs committed"
