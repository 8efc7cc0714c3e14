"""The package's imports form no cycle, function-local imports and TYPE_CHECKING imports included: a cycle
hidden behind an import inside a function is still one module needing the other both ways."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "lib" / "decodescope"


def module_files(package: Path) -> dict[str, Path]:
    mods = {}
    for f in package.rglob("*.py"):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _resolve(name: str, mods: dict) -> str:
    while name and name not in mods:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its body (`from a import b` counts a.b when b
    is a module, else a)."""
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                t = _resolve(t, mods)
                if t and t != m and not m.startswith(t + "."):  # a package's own __init__ is not a cycle
                    graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_detector_finds_a_cycle_behind_a_function_local_import(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from p import a  # hidden\n    return a\n")
    (pkg / "c.py").write_text("from .a import f\n")
    assert cycles(import_graph(module_files(pkg))) == [["p.a", "p.b"]]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(module_files(PACKAGE)))
    assert found == [], f"import cycles: {found}"


def test_the_phases_are_named_in_one_registry():
    """The runner's, the host's, the report's and the comparison's phase sets all come from decodescope.phases."""
    from decodescope import host, params, phases, runner
    from decodescope.report import compare, html

    assert params.PHASES is runner.PHASES is html.PHASES is compare.PHASES is phases.PHASES
    assert runner.SERVER_PHASES is phases.SERVER_PHASES == {"01_serving", "04_profile"}
    assert host.HOST_PHASES is phases.HOST_PHASES and "05_verdict" not in phases.HOST_PHASES
    assert html.PHASE_TITLES is phases.PHASE_TITLES and set(phases.PHASE_TITLES) == set(phases.PHASES)
    assert compare.PHASE_OF is phases.PHASE_OF and phases.PHASE_OF["gemm.parquet"] == "02_gemm"
    # nothing else in the package spells the phase tuple out again
    spelled = [f for f in PACKAGE.rglob("*.py") if f.name != "phases.py"
               and '"00_host", "01_serving", "02_gemm"' in f.read_text()]
    assert spelled == []


def test_the_package_passes_its_linter():
    """ruff with the project's own settings (pyproject.toml [tool.ruff]): no undefined or unused names, no
    syntax errors, no function past the complexity ceiling."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(PACKAGE)],
                          capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
