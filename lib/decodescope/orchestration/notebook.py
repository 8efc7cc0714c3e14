"""What every phase notebook does first: load the params, find (or make) its run directory, and send the
kernel's log records to the run's logs/decodescope.log.

Under papermill the runner injects both; opened in JupyterLab with the default parameters, a notebook
makes its own run directory (`<stamp>-<name>-interactive`) so it runs alone.
"""
from __future__ import annotations

import json
from pathlib import Path

from decodescope.schema.params import load_params, with_experiment, with_overrides
# not through decodescope.orchestration.runner: a phase's kernel would import papermill and nbformat's
# schema checks with it (1.2 s of every phase notebook's first cell)
from decodescope.core.logsetup import LOG_FILE, log_only_to_file
from decodescope.core.rundir import LOGS, ensure_layout, make_run_dir
# re-exported (__all__): the notebooks and the tests name PhaseContext as this module's
from decodescope.schema.phasecontext import PhaseContext


def open_phase(params_path: str, run_dir: str = "", variant: str = "", overrides: str = "") -> PhaseContext:
    """variant: a name from params.experiments; the phase then runs with that variant's settings (its
    run directory is the run's variants/<name>/). overrides: the command line's params overrides as JSON
    ({dotted key: value}), a papermill parameter the runner sets for every phase."""
    params = load_params(params_path)
    if overrides:
        params = with_overrides(params, json.loads(overrides))
    if variant:
        params = with_experiment(params, variant)
    if run_dir:
        path = Path(run_dir)
    else:
        params.run.name = f"{params.run_name}-interactive"
        path = make_run_dir(params.output_root(), params.run_name)
    ctx = PhaseContext(params=params, run_dir=ensure_layout(path).resolve())
    if _in_kernel():  # papermill records a kernel's stdout and stderr as cell outputs: records go to a file
        log_only_to_file(ctx.run_dir / LOGS / LOG_FILE)
    return ctx


def _in_kernel() -> bool:
    """Whether this runs in a notebook kernel (IPython with a kernel attached)."""
    try:
        # IPython: present wherever a kernel is; a script that opens a phase may run without it
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


__all__ = ["PhaseContext", "open_phase"]
