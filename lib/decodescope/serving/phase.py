"""01's sweep for a phase: against the run's server (or one started for this notebook alone), the load
generator here or, with host.loadgen: remote, beside the server on the ssh host."""
from __future__ import annotations

import pandas as pd

from decodescope.exec.runserver import phase_server
from decodescope.schema.phasecontext import PhaseContext
from decodescope.serving.remote import sweep_on_host
from decodescope.serving.sweep import SweepConfig, run_sweep


def sweep_for_phase(ctx: PhaseContext, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The phase's sweep against the run's server (or one started for this notebook alone)."""
    with phase_server(ctx.params, ctx.run_dir) as server:
        server.raise_if_dead("the start of the serving sweep")
        if ctx.params.host.is_remote and ctx.params.host.loadgen == "remote":
            return sweep_on_host(ctx, server)  # the client beside the server, over ssh
        return run_sweep(SweepConfig.from_params(ctx.params, server.base_url), ctx.data_dir, progress,
                         check_server=server.raise_if_dead)
