"""The phase notebooks: which are shipped (under the package's _data/), which a run selects, and one
phase's notebook executed by papermill into the run directory.

A phase's notebook gets the params path and the run directory as papermill parameters (the variant and the
command line's params overrides too, where given); its kernel's own output goes to logs/kernel_<phase>.log.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from jupyter_client.manager import AsyncKernelManager
import papermill as pm

from decodescope.core import resources
from decodescope.core.phases import PHASES
from decodescope.orchestration.runmanifest import RunError
from decodescope.schema.params import Params

# The shipped notebooks, found under the package's _data/ (decodescope.core.resources).
NOTEBOOK_DIR = resources.notebook_dir()


def notebook_for(phase: str, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    return notebook_dir / f"{phase}.ipynb"


def available_phases(notebook_dir: Path = NOTEBOOK_DIR) -> list[str]:
    return [p for p in PHASES if notebook_for(p, notebook_dir).is_file()]


def select_phases(params: Params, requested: Optional[list[str]], notebook_dir: Path = NOTEBOOK_DIR) -> list[str]:
    wanted = requested or params.run.phases or available_phases(notebook_dir)
    unknown = [p for p in wanted if p not in PHASES]
    if unknown:
        raise RunError(f"unknown phase(s) {unknown}; valid: {list(PHASES)}")
    missing = [p for p in wanted if not notebook_for(p, notebook_dir).is_file()]
    if missing:
        raise RunError(f"no notebook for phase(s) {missing} in {notebook_dir}; available: "
                       f"{available_phases(notebook_dir)}")
    return [p for p in PHASES if p in wanted]  # always in phase order


def execute_phase(phase: str, run_dir: Path, params_path: Path, notebook_dir: Path = NOTEBOOK_DIR,
                  variant: str = "", overrides: Optional[dict] = None) -> Path:
    out = run_dir / "notebooks" / f"{phase}.ipynb"
    try:
        _execute(phase, run_dir, params_path, notebook_dir, out, variant, overrides or {})
    except KeyboardInterrupt:
        # the kernel died with the interrupt; nbclient's pending cell task then reports DeadKernelError
        # through asyncio's "exception was never retrieved" log when it is collected: not news to anyone
        import logging

        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise
    return out


def _execute(phase: str, run_dir: Path, params_path: Path, notebook_dir: Path, out: Path,
             variant: str = "", overrides: Optional[dict] = None) -> None:
    parameters = {"params_path": str(params_path), "run_dir": str(run_dir)}
    if variant:
        parameters["variant"] = variant
    if overrides:  # the command line's params overrides (--set), as JSON: open_phase applies them
        parameters["overrides"] = json.dumps(overrides)
    pm.execute_notebook(str(notebook_for(phase, notebook_dir)), str(out), parameters=parameters,
                        kernel_name="python3", progress_bar=False, log_output=False,
                        cwd=str(notebook_dir), request_save_on_cell_execute=True,
                        kernel_manager_class=kernel_manager_logging_to(run_dir / "logs" / f"kernel_{phase}.log"))


def kernel_manager_logging_to(log_path: Path):
    """A kernel manager whose kernel writes its own stdout/stderr (start-up warnings, the traceback of
    a kernel torn down by Ctrl-C) to log_path instead of the user's terminal; what cells print still
    goes into the notebook."""
    class LoggedKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                kw["stdout"] = kw["stderr"] = log  # the child keeps its own copy of the descriptor
                await super()._async_launch_kernel(kernel_cmd, **kw)

    return LoggedKernelManager


def _short_error(exc: BaseException) -> str:
    text = str(exc)
    # papermill's PapermillExecutionError carries ename/evalue: the part worth putting in a table
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        text = f"{ename}: {evalue}"
    return text[:4000]
