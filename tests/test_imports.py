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
    """The runner's, the host's, the report's and the comparison's phase sets all come from decodescope.core.phases."""
    from decodescope.exec import host
    from decodescope.schema import params
    from decodescope.core import phases
    from decodescope.orchestration import phasenotebooks, runner
    from decodescope.report import compare_sources, compare_tables, html

    assert params.PHASES is phasenotebooks.PHASES is html.PHASES is compare_tables.PHASES is phases.PHASES
    assert runner.SERVER_PHASES is phases.SERVER_PHASES == {"01_serving", "04_profile"}
    assert host.HOST_PHASES is phases.HOST_PHASES and "05_verdict" not in phases.HOST_PHASES
    assert html.PHASE_TITLES is phases.PHASE_TITLES and set(phases.PHASE_TITLES) == set(phases.PHASES)
    assert compare_sources.PHASE_OF is phases.PHASE_OF and phases.PHASE_OF["gemm.parquet"] == "02_gemm"
    # nothing else in the package spells the phase tuple out again
    spelled = [f for f in PACKAGE.rglob("*.py") if f.name != "phases.py"
               and '"00_host", "01_serving", "02_gemm"' in f.read_text()]
    assert spelled == []


def test_the_package_its_tests_and_benchmarks_pass_the_linter():
    """ruff with the project's own settings (pyproject.toml [tool.ruff]): no undefined or unused names, no
    syntax errors, no function past the complexity ceiling; in the package, the tests and the benchmarks."""
    import subprocess
    import sys

    repo = PACKAGE.parent.parent
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(PACKAGE),
                           str(repo / "tests"), str(repo / "benchmarks")],
                          capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- function-local imports: each says why it is not at the top of its module --------------------------
# Modules whose function-local imports all share one reason, said here instead of beside each:
LAZY_MODULES = {
    # each subcommand imports what it uses when it runs: `analyze-trace` starts without pydantic or pandas
    # (issue 13's start-up budget; tests/test_trace_stream.py asserts it)
    "cli/main.py": "subcommands import what they use when they run (start-up budget)",
    "cli/analyze_trace.py": "the analyze-trace modes import what they use when they run (start-up budget)",
    # runs on the GPU host over ssh for every small command: the standard library and decodescope.exec.procs only
    "exec/hostagent.py": "the GPU host's agent starts on the standard library and decodescope.exec.procs only",
}


def function_local_imports(source: str) -> list[tuple[int, str, bool]]:
    """(line, the statement's first line, whether a comment says why) for each import inside a function;
    a comment counts on the statement's own lines or on the line right above it (one comment above a
    run of imports, blank lines between its groups included, covers the run)."""
    lines = source.splitlines()
    out = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                own = any("#" in lines[i] for i in range(child.lineno - 1, child.end_lineno))
                above, i = False, child.lineno - 2
                while i >= 0 and (lines[i].strip().startswith(("import ", "from ")) or not lines[i].strip()):
                    own = own or "#" in lines[i]
                    i -= 1
                above = i >= 0 and lines[i].strip().startswith("#")
                out.append((child.lineno, lines[child.lineno - 1].strip(), own or above))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def test_the_detector_finds_a_function_local_import_without_a_reason():
    src = ("import os\n\n"
           "def f():\n    import json\n    return json\n\n"
           "def g():\n    import torch  # optional: the gpu extra only\n    return torch\n\n"
           "def h():\n    # the C library's loader, only where a trace needs it\n    import ctypes\n    import mmap\n"
           "    return ctypes, mmap\n")
    assert [(line, ok) for line, _, ok in function_local_imports(src)] == [(4, False), (8, True), (13, True), (14, True)]


def test_every_function_local_import_says_why_it_is_not_at_the_top():
    """An import inside a function hides a dependency (and once hid the package's import cycles): it is
    at the top of its module unless a comment beside it gives the reason (an optional dependency, a
    start-up budget, a test's stand-in), or its module is one of LAZY_MODULES."""
    bare = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel in LAZY_MODULES:
            continue
        bare += [f"{rel}:{line}: {text}" for line, text, ok in function_local_imports(f.read_text()) if not ok]
    assert bare == [], "function-local imports without a reason beside them:\n" + "\n".join(bare)


# ---- layers: every import points down, or sideways within its layer ---------------------------------------
# Lowest first. The folders are the layers: each top-level folder of lib/decodescope/ is in exactly one
# layer, and no module sits beside them but the package's own __init__ ("" below) and the data folders
# (_avx2_only, _data). DESIGN.md's picture, with three placements it forces:
# - model (arch) sits under schema: params checks a model config against its architecture when it loads
#   (heads and experts divisible by the tensor-parallel size), so the schema needs the architecture;
# - show (escape, display) sits low: a phase may put a note in its notebook while it measures
#   (serving.sweep), and what a note or table shows is escaped in one place;
# - exec.hardware (inventory and peaks) sits with the host seam: the inventory is taken on the run's host,
#   through decodescope.exec.host and the engine's communicator probe; the probes, the programs run there,
#   are in the same layer.
LAYERS = (
    ("core", ("", "core", "engines", "_avx2_only")),
    ("show", ("show",)),
    ("model", ("model",)),
    ("schema", ("schema",)),
    ("exec", ("exec", "probes")),
    ("measure", ("trace", "critpath", "profiling", "serving", "micro")),
    ("verdict", ("verdict",)),
    ("report", ("report",)),
    ("orchestration", ("orchestration",)),
    ("cli", ("cli",)),
)


def layer_of(module: str, layers=LAYERS, package: str = "decodescope") -> int:
    """The index of the module's layer; KeyError when no layer names it."""
    name = module.removeprefix(package).removeprefix(".")
    best = None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (name == p or (p and name.startswith(p + "."))) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    if best is None:
        raise KeyError(f"{module}: in no layer of tests/test_imports.py LAYERS; place it there")
    return best[0]


def upward_imports(graph: dict[str, set[str]], layers=LAYERS, package: str = "decodescope") -> list[str]:
    return sorted(f"{m} ({layers[layer_of(m, layers, package)][0]}) imports {t} "
                  f"({layers[layer_of(t, layers, package)][0]})"
                  for m, targets in graph.items() for t in targets
                  if layer_of(t, layers, package) > layer_of(m, layers, package))


def test_the_layer_check_finds_an_import_pointing_up(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "sub/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "low.py").write_text("def f():\n    from p.sub import high  # hidden in a function\n")
    (pkg / "sub" / "high.py").write_text("from p import low\n")
    (pkg / "sub" / "side.py").write_text("from p.sub import high\n")
    layers = (("low", ("", "low")), ("high", ("sub",)))
    assert upward_imports(import_graph(module_files(pkg)), layers, "p") == ["p.low (low) imports p.sub.high (high)"]


def test_every_module_is_in_a_layer_and_imports_only_down_or_sideways():
    graph = import_graph(module_files(PACKAGE))
    unplaced = []
    for m in graph:
        try:
            layer_of(m)
        except KeyError as e:
            unplaced.append(str(e))
    assert unplaced == []
    assert upward_imports(graph) == []


def test_the_layers_are_the_folders():
    """Each layer names whole top-level folders (no module of one folder in another's layer), every folder
    is named by one layer, and only the package's __init__ sits at the top beside them."""
    named = [p for _, prefixes in LAYERS for p in prefixes if p]
    assert all("." not in p for p in named), named
    assert len(named) == len(set(named))
    folders = {d.name for d in PACKAGE.iterdir() if d.is_dir() and d.name != "__pycache__" and d.name != "_data"}
    assert folders == set(named)
    assert sorted(f.name for f in PACKAGE.glob("*.py")) == ["__init__.py"]


def test_the_analysis_side_imports_without_torch():
    """torch and vllm come with the cpu/gpu extras; every module but the probes (GPU-host programs) imports
    without them, so function-local imports that keep them out stay local."""
    import subprocess
    import sys

    code = ("import importlib, pkgutil, sys, decodescope\n"
            "probes = ('decodescope.probes.gemm', 'decodescope.probes.gemm_kernels', 'decodescope.probes.collectives', 'decodescope.probes.step',\n"
            "          'decodescope.probes.communicators',\n"
            "          'decodescope._avx2_only.sitecustomize')\n"
            "for m in pkgutil.walk_packages(decodescope.__path__, 'decodescope.'):\n"
            "    if m.name not in probes:\n"
            "        importlib.import_module(m.name)\n"
            "print(sorted(m for m in ('torch', 'vllm', 'pynvml') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---- sizes: a module fits in a head (500 lines), a function on a screen or two (80 lines) -----------------
MODULE_MAX_LINES = 500
FUNCTION_MAX_LINES = 80
# Ratchets for what is still over (issue 28): each may shrink, none may grow, and each leaves the list
# once under the limit (the test says so). trace/_kscan.c, the C scanner, is not Python and not counted.
MODULES_OVER = {}
FUNCTIONS_OVER: dict[str, int] = {}


def function_lengths(source: str) -> dict[str, int]:
    """name -> lines from `def` to its last line (decorators apart, docstring included), for every
    function and method; a nested function counts on its own and inside its parent."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = max(out.get(node.name, 0), node.end_lineno - node.lineno + 1)
    return out


def test_function_lengths_count_from_def_to_the_last_line():
    src = "def f():\n    x = 1\n\n    return x\n\n\nclass C:\n    def m(self):\n        pass\n"
    assert function_lengths(src) == {"f": 4, "m": 2}


def _over(limit: int, sizes: dict[str, int], ratchet: dict[str, int]) -> list[str]:
    problems = [f"{k}: {n} lines, over {limit}" for k, n in sorted(sizes.items()) if n > limit and k not in ratchet]
    problems += [f"{k}: {sizes.get(k, 0)} lines, more than its ratchet {n}" for k, n in ratchet.items()
                 if sizes.get(k, 0) > n]
    problems += [f"{k}: {sizes.get(k, 0)} lines, within {limit}: take it out of the ratchet" for k in ratchet
                 if sizes.get(k, 0) <= limit]
    return problems


def test_no_module_is_over_500_lines_but_the_ratcheted_ones():
    sizes = {f.relative_to(PACKAGE).as_posix(): len(f.read_text().splitlines()) for f in PACKAGE.rglob("*.py")}
    assert _over(MODULE_MAX_LINES, sizes, MODULES_OVER) == []


def test_no_function_is_over_80_lines_but_the_ratcheted_ones():
    sizes = {f"{f.relative_to(PACKAGE).as_posix()}:{name}": n for f in PACKAGE.rglob("*.py")
             for name, n in function_lengths(f.read_text()).items()}
    assert _over(FUNCTION_MAX_LINES, sizes, FUNCTIONS_OVER) == []


# ---- mypy: the package type-checks (pyproject.toml [tool.mypy], pydantic's plugin) -------------------------
# Errors per module when mypy first ran on the package (issue 28: 198, none of them an undefined name) were a
# ratchet like the size limits; none is left. A module listed here may only lose errors and leaves the list
# at none; a new error anywhere fails the test.
MYPY_ERRORS: dict[str, int] = {}


def mypy_errors_by_module(output: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in output.splitlines():
        path, sep, rest = line.partition(":")
        if sep and ": error:" in rest and path.startswith("lib/decodescope/"):
            key = path.removeprefix("lib/decodescope/")
            out[key] = out.get(key, 0) + 1
    return out


def test_mypy_errors_are_counted_per_module():
    out = ("lib/decodescope/a.py:3: error: x  [arg-type]\nlib/decodescope/a.py:9: note: y\n"
           "lib/decodescope/b/c.py:1: error: z  [misc]\nFound 2 errors in 2 files\n")
    assert mypy_errors_by_module(out) == {"a.py": 1, "b/c.py": 1}


def test_the_package_type_checks_but_for_the_ratcheted_errors():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-color-output", "--no-error-summary"],
                          capture_output=True, text=True, timeout=1200, cwd=PACKAGE.parent.parent)
    assert "No module named mypy" not in proc.stderr, "mypy is in the dev extras: make install-dev"
    found = mypy_errors_by_module(proc.stdout)
    assert _over(0, found, MYPY_ERRORS) == [], proc.stdout[-4000:]


def _bare_python(code: str, timeout_s: float = 120):
    """`python -c code` with only the package on the path: what a fresh process of it imports."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"})


def test_the_hosts_agent_starts_on_the_standard_library_procs_and_privatedirs_only():
    """hostagent runs on the GPU host for every supervised process and small command (LAZY_MODULES says
    so); a top-level import of the host seam once brought pydantic and urllib into it (0.46-0.56 s a start)."""
    proc = _bare_python("import sys, decodescope.exec.hostagent\n"
                        "print(sorted(m for m in sys.modules if m.startswith('decodescope') or m in ('pydantic', "
                        "'urllib.request')))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("['decodescope', 'decodescope.exec', 'decodescope.exec.hostagent', "
                                   "'decodescope.exec.privatedirs', 'decodescope.exec.procs']")


def test_a_phase_notebook_starts_without_papermill():
    """Every phase notebook's first cell imports decodescope.orchestration.notebook; through the runner it
    once brought papermill and nbformat's schema checks (1.2 s of each phase, six phases a run)."""
    proc = _bare_python("import sys, decodescope.orchestration.notebook, decodescope.report.sections\n"
                        "print(sorted(m for m in ('papermill', 'nbformat', 'nbconvert', 'jsonschema', "
                        "'decodescope.orchestration.runner') if m in sys.modules))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_every_import_in_the_notebooks_resolves():
    """The notebooks' imports name the package's modules by their folders; a stale name fails here, in
    the fast lane, not only in the first papermill phase of an integration run."""
    import json

    repo = PACKAGE.parent.parent
    statements = []
    for nb in sorted((repo / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            tree = ast.parse("\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))))
            statements += [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert any("decodescope" in s for s in statements)
    proc = _bare_python("\n".join(dict.fromkeys(statements)), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_readme_is_read_in_minutes_and_its_links_resolve():
    """Issue 28: the README for a newcomer, at most about 2,000 words; methods and results live in docs/,
    and every relative link of the README points at a file that exists (and a heading there, for #anchors)."""
    import re

    repo = PACKAGE.parent.parent
    text = (repo / "README.md").read_text()
    assert len(text.split()) <= 2000
    broken = []
    for target in re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", text):
        path, anchor = target
        f = repo / path
        if not f.exists():
            broken.append(path)
        elif anchor:
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", f.read_text(), re.M)}
            if anchor not in slugs:
                broken.append(f"{path}#{anchor}")
    assert broken == []
