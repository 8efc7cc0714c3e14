"""The engine seam: everything decodescope needs of a serving engine comes from decodescope.engines, vLLM is
its one implementation, and the rest of the package names no vLLM endpoint, metric, flag or annotation."""
import ast
import inspect
import re
from pathlib import Path

import pytest

from decodescope.engines import engine
from decodescope.engines.base import Engine
from decodescope.schema.params import ParamsError, load_params

PACKAGE = Path(__file__).parent.parent / "lib" / "decodescope"
REPO = PACKAGE.parent.parent
# what only an engine module may spell: its endpoints, metric names, flags, environment, step annotations
ENGINE_KNOWLEDGE = re.compile(r'^/(start|stop)_profile$|^/health$|^/v1/models$|vllm\.entrypoints|\bvllm:[a-z_]|'
                              r'execute_context_|VLLM_API_KEY|VLLM::|VLLM_TORCH_PROFILER|^--profiler-config$|'
                              r'^speculative-config$')
# modules that still spell some of it, and why
STILL_NAMED = {
    "exec/procs.py": "the process names a run's teardown looks for: the GPU host's agent imports procs alone",
}


def test_vllm_provides_every_part_of_the_seam():
    e = engine("vllm")
    abstract = {n for n, v in inspect.getmembers(Engine) if getattr(v, "__isabstractmethod__", False)}
    assert abstract <= set(dir(e)) and not getattr(type(e), "__abstractmethods__", set())
    for name, kind in Engine.__annotations__.items():
        assert getattr(e, name), f"vLLM's {name} is empty"
    label = e.step_label(0, 0, 4, 4)   # the step replay (probes/step.py) names its steps so 04 reads them
    assert [int(g) for g in e.step_name.search(label).groups()] == [0, 0, 4, 4] and e.step_any.search(label)
    argv = e.server_argv("py", "/m", "/t", ["tiny", "decodescope-abc"], "127.0.0.1", 8765, 2)
    assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--served-model-name") + 1:argv.index("--host")] == ["tiny", "decodescope-abc"]
    assert argv[-2:] == ["--tensor-parallel-size", "2"]


@pytest.mark.parametrize("version,style", [("0.26.0", "config"), ("0.12.0rc1", "env"), ("0.13.0", "config"),
                                           ("0.10.1.dev5+g1234", "env"), ("", "config")])
def test_the_profiler_is_turned_on_as_the_engines_version_takes_it(version, style, tmp_path):
    e = engine()
    assert e.profiler_style(version) == style
    argv, env, keys = ["x", "--profiler-config", "{}"], {}, []
    e.add_profiler(argv, env, keys, str(tmp_path), style, with_stack=False)
    read = e.profiler_from_launch(argv, env)   # what an attached server's /proc shows, read back the same way
    assert read["configured"] is True and read["torch_profiler_dir"] == str(tmp_path.resolve())
    assert read["torch_profiler_with_stack"] is False and argv.count("--profiler-config") == (style == "config")


def test_the_engines_log_states_its_modes():
    line = ("INFO [core.py:93] Initializing a V1 LLM engine (v0.26.0) with config: model='m', enforce_eager=False, "
            "compilation_config={'mode': <CompilationMode.VLLM_COMPILE: 3>, 'cudagraph_mode': "
            "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>, 'splitting_ops': ['vllm::unified_attention_with_output']}")
    (m,) = engine().modes_from_log(line)
    assert (m.vllm_version, m.cudagraph_mode, m.compilation_mode, m.splitting_ops) == (
        "0.26.0", "FULL_AND_PIECEWISE", "VLLM_COMPILE", ("vllm::unified_attention_with_output",))


def test_an_engine_decodescope_does_not_know_is_refused_naming_the_field_and_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'sglang' is not one decodescope knows; valid: vllm"):
        engine("sglang")
    params = tmp_path / "p.yaml"
    params.write_text((REPO / "params" / "default.yaml").read_text().replace("server:\n", "server:\n  engine: sglang\n", 1)
                      .replace("config: models/", f"config: {REPO}/params/models/"))
    with pytest.raises(ParamsError) as e:
        load_params(params)
    assert "server.engine" in str(e.value) and "valid: vllm" in str(e.value)
    assert load_params(REPO / "params" / "default.yaml").server.engine == "vllm"


def _knowledge_outside_the_seam() -> dict[str, list[str]]:
    """Per module outside engines/: the string constants (docstrings, messages and field descriptions aside)
    that spell engine knowledge."""
    out: dict[str, list[str]] = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel.startswith("engines/"):
            continue
        tree = ast.parse(f.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and ast.get_docstring(n) is not None}
        in_messages = {id(c) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for c in ast.walk(n)}
        # a record field's description documents the sample it is read from; it reads nothing
        in_messages |= {id(c) for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "description"
                        for c in ast.walk(n.value)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in docs \
                    and id(node) not in in_messages:
                text = node.value.decode(errors="replace") if isinstance(node.value, bytes) else node.value
                if ENGINE_KNOWLEDGE.search(text) and text.count(" ") < 3:  # prose names; it reads nothing
                    out.setdefault(rel, []).append(text[:60])
    return out


def test_no_module_outside_the_seam_spells_what_an_engine_is_but_those_named_with_a_reason():
    found = _knowledge_outside_the_seam()
    assert set(found) <= set(STILL_NAMED), {k: v for k, v in found.items() if k not in STILL_NAMED}
    assert set(STILL_NAMED) <= set(found), "no longer spells it: leaves STILL_NAMED"
