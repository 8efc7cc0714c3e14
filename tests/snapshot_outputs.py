"""Behaviour unchanged, shown on recorded run directories: the code at a base commit and the code in this
tree each rebuild, from the same run directories, data/verdict.json (bytes as write_record writes them),
every verdict section's displayed outputs, the index page's body and the comparison page's blocks; the
two sets must be byte-identical.

    python tests/snapshot_outputs.py [--base 6fb5b71] [RUN_DIR[=PARAMS] ...]

Without RUN_DIRs: the recorded runs under tests/fixtures/runs/ (FIXTURE_PARAMS names their params file: a
run's own params.yaml names its model config relative to the repository's params/ folder). Exit status 0 when identical, 1 when any output
differs (the differing names are printed). Each side runs in its own interpreter with its own lib/ first on
sys.path, so nothing of one tree leaks into the other's imports.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE_RUNS = REPO / "tests" / "fixtures" / "runs"
VERDICT_SECTIONS = ("verdict_headline", "verdict_findings", "verdict_attribution", "verdict_reconcile",
                    "verdict_replay", "verdict_levels", "verdict_projections", "verdict_variants",
                    "verdict_curves", "verdict_serving")
# pandas' Styler names each table's CSS with a random id (T_1a2b3): the same table, another id
STYLER_ID = re.compile(r"T_[0-9a-f]{5}")
FIXTURE_PARAMS = {"vllm_gpu_h200_qwen3moe": REPO / "params" / "h200-qwen3moe.yaml",
                  "vllm_gpu_h200_qwen3moe_pinned": REPO / "params" / "h200-qwen3moe-pinned.yaml",
                  "vllm_gpu_h200_kimi_int4": REPO / "params" / "h200-kimi-int4.yaml"}


def _displayed(obj, raw: bool = False) -> str:
    """One displayed output as text: a figure bundle's plotly JSON (its HTML div carries a random id),
    else the HTML or Markdown object's data."""
    if isinstance(obj, dict):
        return json.dumps(obj.get("application/vnd.plotly.v1+json"), sort_keys=True, default=str)
    return STYLER_ID.sub("T_styler", str(getattr(obj, "data", obj)))


def snapshot(runs: list[tuple[Path, Path]], out: Path) -> None:
    """Writes each output of the tree on sys.path as a file under out (run in a child interpreter)."""
    import IPython.display

    from decodescope.report import compare, index, sections
    try:
        from decodescope.schema.params import load_params
        from decodescope.schema.records import write_record
        from decodescope.verdict.verdict import verdict
        from decodescope.show import display as report_display
    except ImportError:  # a base commit from before the layer folders (c35b06e and older)
        from decodescope.params import load_params
        from decodescope.records import write_record
        from decodescope.verdict import verdict
        from decodescope.report import display as report_display

    shown: list[str] = []
    def capture(*objs, **kw):
        shown.extend(_displayed(o) for o in objs)

    # IPython's, and the name report.display holds where it imports it at its top
    IPython.display.display = capture
    if hasattr(report_display, "display"):
        report_display.display = capture
    run_dirs = [run_dir for run_dir, _ in runs]
    for run_dir, params_path in runs:
        name = run_dir.name
        v = verdict(run_dir, load_params(params_path))
        write_record(out / f"{name}.verdict.json", v)
        for section in VERDICT_SECTIONS:
            shown.clear()
            getattr(sections, section)(v)
            (out / f"{name}.{section}.txt").write_text("\n".join(shown))
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for run_dir in run_dirs:
            (root / run_dir.name).symlink_to(run_dir.resolve(), target_is_directory=True)
        (out / "index.html").write_text(index.render_index(index.collect_rows(root), index.compare_pages(root)))
        sources = compare.load_sources([str(root / d.name) for d in run_dirs] * (2 if len(run_dirs) == 1 else 1))
        blocks = compare.comparison_blocks(sources, root)
        (out / "compare.txt").write_text("\n".join(
            f"{b.kind}|{getattr(b, 'anchor', '')}|" + (json.dumps(b.content.to_plotly_json(), sort_keys=True,
                                                                   default=str) if b.kind == "figure"
                                                        else STYLER_ID.sub("T_styler", str(b.content)))
            for b in blocks))


def _run_side(lib: Path, runs: list[tuple[Path, Path]], out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(lib), "PYTHONHASHSEED": "0"}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from snapshot_outputs import snapshot; "
            "from pathlib import Path; snapshot([tuple(map(Path, a.split('='))) for a in sys.argv[3:]], "
            "Path(sys.argv[2]))")
    subprocess.run([sys.executable, "-W", "ignore", "-c", code, str(REPO / "tests"), str(out),
                    *(f"{d}={p}" for d, p in runs)], env=env, check=True, cwd=out)
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="6fb5b71", help="the commit whose lib/ is the reference")
    ap.add_argument("runs", nargs="*", help="RUN_DIR[=PARAMS]; PARAMS defaults to RUN_DIR/params.yaml")
    args = ap.parse_args(argv)
    specs = [a.split("=", 1) for a in args.runs] or [[str(FIXTURE_RUNS / n), str(p)] for n, p in FIXTURE_PARAMS.items()]
    runs = [(Path(s[0]).resolve(), Path(s[1] if len(s) > 1 else Path(s[0]) / "params.yaml").resolve()) for s in specs]
    run_dirs = [d for d, _ in runs]
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        base_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base, "lib", "notebooks", "params"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        before = _run_side(base_tree / "lib", runs, Path(tmp) / "before")
        after = _run_side(REPO / "lib", runs, Path(tmp) / "after")
    differ = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    for n in sorted(before):
        print(f"{'DIFFERS' if n in differ else 'same   '} {before[n][:16]} {n}")
    print(f"{len(before) - len(differ)} of {len(before)} outputs byte-identical between {args.base} and this tree "
          f"over {len(run_dirs)} run directories: {', '.join(d.name for d in run_dirs)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
