"""The `decodescope` command. Each subcommand imports what it uses when it runs: `analyze-trace` starts
without pydantic or pandas (issue 13's start-up budget)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


# Exit statuses of `decodescope run` (README: "Exit status"); the fault tests assert them.
EXIT_OK, EXIT_PHASE_FAILED, EXIT_BAD_INPUT, EXIT_WRITE_FAILED = 0, 1, 2, 3
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


def _cmd_run(args) -> int:
    from decodescope.exec.hostcore import HostError
    from decodescope.exec.locks import LockHeld
    from decodescope.schema.params import ParamsError
    from decodescope.orchestration.runmanifest import ResultsWriteError, RunError
    from decodescope.orchestration.runner import Terminated, run

    try:
        overrides = {"workload.repeats": args.repeats} if args.repeats else {}
        if args.variants is not None:
            overrides["experiments"] = _variants_kept(args.params, args.variants)
        run_dir, ok = run(Path(args.params), phases=args.phases, resume=Path(args.resume) if args.resume else None,
                          overrides=overrides or None)
    except ResultsWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except (ParamsError, RunError, LockHeld, HostError) as e:  # HostError: the ssh host unreachable or unusable
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        print(f"{what}: the manifest and the data written so far are kept; the server is stopped",
              file=sys.stderr)
        return EXIT_SIGTERM if isinstance(e, Terminated) else EXIT_SIGINT
    print(f"run directory: {run_dir}", file=sys.stderr)
    if not ok:
        print("some phases failed: see manifest.json and the report", file=sys.stderr)
    print(run_dir / "report.html")
    return EXIT_OK if ok else EXIT_PHASE_FAILED


def _variants_kept(params_path: str, names: list[str]) -> list[dict]:
    """The params' experiments named on the command line (`--variants none`: none), as the override
    of `experiments`; an unknown name is an error that lists the valid ones."""
    from decodescope.schema.params import ParamsError, load_params

    experiments = load_params(params_path).experiments
    if names == ["none"]:
        return []
    known = [e.name for e in experiments]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ParamsError(params_path, [("experiments", f"--variants {', '.join(unknown)}: no such variant; "
                                         f"valid: {', '.join(known) or '(none defined)'}, or none")])
    return [e.model_dump() for e in experiments if e.name in names]


def _load_or_report(path: str):
    """The params, or None after printing every problem (exit status 2 for the caller)."""
    from decodescope.schema.params import ParamsError, load_params

    try:
        return load_params(path)
    except ParamsError as e:
        print(e, file=sys.stderr)
        return None


def _cmd_params_validate(args) -> int:
    from decodescope.schema.params import unread_keys

    p = _load_or_report(args.file)
    if p is None:
        return 2
    for key, why in unread_keys(args.file):  # warnings, not errors: the file still runs
        print(f"warning: {args.file}: {key} is read by no phase ({why})", file=sys.stderr)
    print(f"{args.file}: ok (run name {p.run_name!r}, model {p.model.name!r}, TP={p.server.tensor_parallel})")
    return 0


def _cmd_params_show(args) -> int:
    p = _load_or_report(args.file)
    if p is None:
        return 2
    from decodescope.schema.params import dump_yaml

    sys.stdout.write(dump_yaml(p))
    return 0


def _cmd_params_init(args) -> int:
    """Copy a shipped params template (and the model configs it points to) into a directory of yours:
    the same files from a wheel as from the repository."""
    import shutil

    from decodescope.core.resources import params_dir

    templates = sorted(p.stem for p in params_dir().glob("*.yaml") if p.stem != "kernel_categories")
    if args.template not in templates:
        print(f"error: no params template {args.template!r}; shipped templates: {templates}", file=sys.stderr)
        return 2
    dest = Path(args.dest)
    target = dest / f"{args.template}.yaml"
    if target.exists():
        print(f"error: {target} exists; choose another directory or remove it", file=sys.stderr)
        return 2
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(params_dir() / f"{args.template}.yaml", target)
    shutil.copytree(params_dir() / "models", dest / "models", dirs_exist_ok=True)
    print(target)
    return 0


def _cmd_report(args) -> int:
    from decodescope.report.html import build_report

    print(build_report(Path(args.run_dir)))
    return 0


def _cmd_index(args) -> int:
    from decodescope.report.index import build_index, default_output_dir

    out = Path(args.output_dir) if args.output_dir else default_output_dir()
    if not out.is_dir():
        print(f"error: {out}: not a directory", file=sys.stderr)
        return 2
    try:
        print(build_index(out))
    except OSError as e:
        print(f"error: could not write {out / 'index.html'}: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    return 0


def _cmd_compare(args) -> int:
    """The page and compare.json; with a gate, the exit status says whether a figure regressed (README:
    "Exit status": 0 none, 1 a regression, 2 bad input, 3 a write failed, 4 runs not comparable)."""
    from decodescope.report.compare import CompareError, run_compare
    from decodescope.report.compare_gate import (EXIT_BAD_INPUT, EXIT_WRITE_FAILED, GateError, parse_allowed,
                                                 parse_gates, resolve_baseline, summary_lines)

    try:
        gates = parse_gates(args.gate, args.gate_metric or [])
        allowed = parse_allowed(args.allow_mismatch or [])
        specs = list(args.runs)
        if args.baseline:
            base = resolve_baseline(args.baseline, specs, Path(args.output_dir) if args.output_dir else None)
            print(f"baseline {args.baseline}: {base}", file=sys.stderr)
            specs = [base, *specs]
        page, record, result = run_compare(specs, Path(args.out) if args.out else None, gates, allowed)
    except (CompareError, GateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"error: could not write the compare page: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    for line in summary_lines(result):
        print(line, file=sys.stderr)
    print(f"compare.json: {record}", file=sys.stderr)
    print(page)
    return result.exit_status


def _cmd_analyze_trace(args) -> int:
    from decodescope.cli.analyze_trace import analyze_trace_command

    return analyze_trace_command(args)


def _cmd_wheelhouse(args) -> int:
    from decodescope.exec.wheelhouse import MANYLINUX_X86_64, Target, WheelhouseError, build

    platforms = tuple(args.platform) or (MANYLINUX_X86_64 if args.python_version else ())
    target = Target(python_version=args.python_version, platforms=platforms)
    try:
        made = build(Path(args.out), Path(args.project), extras=tuple(args.extras or ()), target=target,
                     host_packages=Path(args.host_packages) if args.host_packages else None,
                     skip=tuple(args.skip or ()))
    except (WheelhouseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {made['decodescope_wheel']} and {len(made['downloaded'])} wheels "
          f"({len(made['left_to_host'])} left to the host)")
    print(f"on the host: pip install --no-index --find-links {args.out} decodescope")
    return 0


def _add_compare(sub) -> None:
    """`compare`'s arguments (the page, the gate, named baselines)."""
    cmp = sub.add_parser("compare", help="two or more runs or variants side by side on one offline page")
    cmp.add_argument("runs", nargs="+", metavar="RUN",
                     help="run directories (outputs/<run>), or variants as RUN_DIR/variants/NAME or RUN_DIR:NAME; "
                          "the first is the base")
    cmp.add_argument("--out", help="the page (default: <the first run's output folder>/compare/<A>-vs-<B>.html); "
                                   "compare.json is written beside it (<page>.json)")
    cmp.add_argument("--gate", metavar="PCT", help="exit 1 when a later run is worse than the base by more than PCT%% "
                     "and by more than the noise (the 95%% band over repeats) in any serving figure (throughput, "
                     "TPOT, TTFT, E2E p50, per level) or the step's wall time; without repeats the gate alone")
    cmp.add_argument("--gate-metric", action="append", metavar="NAME=PCT",
                     help="a gate for one family (throughput, tpot, ttft, e2e, step, category), part (step.busy, "
                          "category.gemm) or level (tpot@4), or `off`; repeatable; the most specific wins")
    cmp.add_argument("--baseline", metavar="NAME", help="the base: a run directory, or a run in the output folder "
                     "by directory name, run_id or params name (the newest); the RUNs are set against it")
    cmp.add_argument("--output-dir", help="where --baseline looks (default: the RUNs' folders, then outputs/)")
    cmp.add_argument("--allow-mismatch", action="append", metavar="KEY",
                     help="gate runs that differ in this (model, tensor_parallel, engine_version, all_reduce, host, "
                          "or all; repeatable); otherwise a gate refuses them (exit 4)")
    cmp.set_defaults(func=_cmd_compare)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodescope",
                                     description="Where does decode time go on this host, and what would move it?")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the phase notebooks with papermill and build report.html")
    run.add_argument("params", help="params YAML, e.g. params/default.yaml")
    run.add_argument("--phases", nargs="+", help="phases to run (default: all notebooks), e.g. 00_host 04_profile")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run, skipping phases already ok")
    run.add_argument("--variants", nargs="+", metavar="NAME", help="measure only these of the params' experiments "
                     "(`none`: the baseline alone)")
    run.add_argument("--repeats", type=int, metavar="N", help="measure each serving level N times "
                     "(workload.repeats): medians with a 95%% band")
    run.set_defaults(func=_cmd_run)

    params = sub.add_parser("params", help="check or show a params file")
    psub = params.add_subparsers(dest="params_command", required=True)
    v = psub.add_parser("validate", help="validate; list every problem at once")
    v.add_argument("file")
    v.set_defaults(func=_cmd_params_validate)
    s = psub.add_parser("show", help="print the params resolved, with defaults (secrets redacted)")
    s.add_argument("file")
    s.set_defaults(func=_cmd_params_show)
    i = psub.add_parser("init", help="copy a shipped template and its model configs into DEST, to edit")
    i.add_argument("template", help="e.g. default or kimi-k2.5-int4-8x-pcie")
    i.add_argument("dest", help="directory to copy into (made if missing)")
    i.set_defaults(func=_cmd_params_init)

    rep = sub.add_parser("report", help="rebuild report.html of a run directory")
    rep.add_argument("run_dir")
    rep.set_defaults(func=_cmd_report)

    idx = sub.add_parser("index", help="write OUTPUT_DIR/index.html listing every run, with headline numbers "
                                       "and links to reports and compare pages")
    idx.add_argument("output_dir", nargs="?", help="folder of run directories (default: the repository's outputs/)")
    idx.set_defaults(func=_cmd_index)

    _add_compare(sub)

    at = sub.add_parser("analyze-trace", help="per-rank breakdown of a directory of torch.profiler traces")
    at.add_argument("trace_dir")
    at.add_argument("--model-config", help="HF config.json, for expected collectives per step")
    at.add_argument("--tp", type=int, help="tensor-parallel size (default: ranks found)")
    at.add_argument("--out", help="directory for kernels.parquet and profile_summary.json (breakdown.json with "
                                  "--breakdown); default: TRACE_DIR/analysis")
    at.add_argument("--workers", type=int, default=None,
                    help="rank files read at once (default: the cores): processes for the full analysis, threads "
                         "for --breakdown")
    at.add_argument("--breakdown", action="store_true",
                    help="time by category and by name only, reduced as the files are read: memory stays a few "
                         "chunks whatever the traces' size (writes breakdown.json)")
    at.add_argument("--critical-path", action="store_true",
                    help="each step's critical path across streams, threads and ranks: the wall step by category "
                         "beside the summed shares, collective waits, what a fix could buy at most (writes "
                         "critical_path.parquet, critical_path.json and critical_path.trace.json.gz: the path as a "
                         "Chrome trace for Perfetto, beside the rank traces)")
    at.add_argument("--speedup", type=float, default=float("inf"),
                    help="with --critical-path: the bounds with a category this many times faster (default: free)")
    at.set_defaults(func=_cmd_analyze_trace)

    wh = sub.add_parser("wheelhouse", help="decodescope's wheel and the wheels it needs that a GPU host without a "
                                           "package index lacks, for that host's Python and platform")
    wh.add_argument("out", help="folder for the wheels (made if missing)")
    wh.add_argument("--project", default=".", help="the decodescope source tree (default: .)")
    wh.add_argument("--extras", nargs="*", help="extras to include, e.g. gpu (torch and vllm: leave them out "
                                                "where the host has its own)")
    wh.add_argument("--python-version", help="the host's Python, e.g. 3.12 (default: this interpreter's)")
    wh.add_argument("--platform", action="append", default=[],
                    help="pip platform tag, repeatable (default with --python-version: manylinux x86_64 2.17-2.39)")
    wh.add_argument("--host-packages", help="the host's `pip list --format=freeze`: pinned as constraints and "
                                            "left out of the downloads")
    wh.add_argument("--skip", nargs="*", help="packages to leave out too (e.g. vllm where a bundle brings it)")
    wh.set_defaults(func=_cmd_wheelhouse)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
