"""probes.timing's split of a CPU's calls by the scheduler tick: the calls a tick stalled against the rest."""
import sys
import time

import pytest

from decodescope.probes.timing import median_spread, scheduler_tick_us, tick_stalls


def test_calls_half_a_tick_past_the_fastest_are_the_stalled_ones():
    """By hand, a 4,000 us tick: ten calls of 300-390 us and ten of 4,100-4,190 us (a spin that ran to the
    tick), 50% stalled. p10 is 310 us, so the limit is 310 + 2,000 = 2,310 us. The median over all calls
    falls between the modes (2,245 us); the median of the unstalled ten is 345 us."""
    fast = [300.0 + 10 * i for i in range(10)]
    slow = [4100.0 + 10 * i for i in range(10)]
    calls = slow + fast
    assert median_spread(calls)["time_us"] == pytest.approx((390.0 + 4100.0) / 2)
    split = tick_stalls(calls, 4000.0)
    assert split == {"tick_us": 4000.0, "stalled_share": pytest.approx(0.5), "unstalled_us": pytest.approx(345.0)}
    # a call 1 us short of the limit is not stalled, one at it is
    assert tick_stalls(fast + [2309.0], 4000.0)["stalled_share"] == 0.0
    assert tick_stalls(fast + [2310.0], 4000.0)["stalled_share"] == pytest.approx(1 / 11)


def test_a_message_slower_than_a_tick_is_not_called_stalled():
    """The limit sits half a tick past the fastest calls, not at half a tick: forty calls of 21.0-21.4 ms
    (a 16 MB gloo all-reduce) against a 4 ms tick have no stall in it."""
    calls = [21_000.0 + 10 * i for i in range(40)]
    split = tick_stalls(calls, 4000.0)
    assert split["stalled_share"] == 0.0 and split["unstalled_us"] == pytest.approx(median_spread(calls)["time_us"])


def test_without_a_tick_or_calls_there_is_no_split():
    assert tick_stalls([300.0, 4100.0], None) == {} and tick_stalls([], 4000.0) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CLOCK_MONOTONIC_COARSE is Linux's")
def test_the_tick_is_the_coarse_clocks_step():
    """On Linux the tick is what CLOCK_MONOTONIC_COARSE advances by: 1,000 to 10,000 us (CONFIG_HZ 1000 to 100).
    That clock moves when a tick updates the kernel's time, so a step of it is about a whole number of ticks
    (the tick's interrupt comes a little late or early)."""
    tick_us = scheduler_tick_us()
    assert tick_us is not None and 1000.0 <= tick_us <= 10_000.0
    a = time.clock_gettime_ns(6)
    while (b := time.clock_gettime_ns(6)) == a:
        pass
    ticks = (b - a) / 1e3 / tick_us
    assert round(ticks) >= 1 and abs(ticks - round(ticks)) < 0.25, ticks


def test_the_03_method_note_says_how_many_calls_a_tick_stalled_and_only_where_the_probe_split_them():
    import pandas as pd

    from decodescope.report.micro_view import tick_stall_note

    rows = [{"part": "sweep", "timing": "back_to_back", "communicator": "torch_gloo", "bytes": n, "time_us": t,
             "tick_us": 4000.0, "stalled_share": share, "unstalled_us": u, "rank": r}
            for r in (0, 1) for n, t, share, u in ((512, 2200.0, 0.45 + 0.05 * r, 400.0), (1024, 700.0, 0.2, 390.0))]
    rows.append({"part": "sweep", "timing": "isolated", "communicator": "torch_gloo", "bytes": 512, "time_us": 900.0})
    note = tick_stall_note(pd.DataFrame(rows))
    assert "(4,000 us)" in note and "torch_gloo at 512 B: 50% stalled, median 2,200 us over all calls and 400 us" in note
    assert tick_stall_note(pd.DataFrame(rows).drop(columns=["tick_us", "stalled_share", "unstalled_us"])) == ""
