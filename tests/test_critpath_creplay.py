"""The what-if replay in C (_kscan.c: cp_replay) gives the Python replay's wall times to the bit."""
from pathlib import Path

import numpy as np
import pytest

from decodescope.trace.analyze import find_steps, op_table
from decodescope.critpath.table import critical_paths
from decodescope.critpath.whatif import _CReplay, _Flat, member_chains, replay_step, step_rows
from decodescope.trace.cscan import library
from decodescope.trace.load import load_trace_dir

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


@pytest.mark.parametrize("trace", ["vllm_cpu_tp2_c4", "h200x2_step_replay_graph"])
def test_the_c_replay_gives_the_python_replays_wall_times_to_the_bit(trace):
    lib = library()
    if lib is None:
        pytest.skip("no C compiler: the scanner is not built")
    loaded = load_trace_dir(FIXTURES / trace)
    ops = op_table(loaded.events)
    cp = critical_paths(loaded.events, ops, find_steps(loaded.events, ops))
    p, ln, cat = cp.labelled.pieces, cp.links, cp.labelled.category
    fast, flat = _CReplay(lib, p, ln), _Flat(p, ln)
    for a, b in zip(cp.windows["start_us"].tolist()[:8], cp.windows["end_us"].tolist()[:8]):
        rows = step_rows(p, ln, a, b)
        for c in sorted(set(cat[rows].tolist()))[:4]:
            scale = np.where(cat == c, 0.5, 1.0)
            assert fast(rows, member_chains(p, rows), scale, a, b) == replay_step(p, ln, a, b, scale, flat, rows)
