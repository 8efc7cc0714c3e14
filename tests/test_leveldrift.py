"""A serving level's own drift while it ran and what the step model's miss is put down to
(decodescope.verdict.leveldrift), on hand-worked numbers; and the verdict's level rows carrying them."""
from __future__ import annotations

import pandas as pd
import pytest

from decodescope.verdict import leveldrift
from decodescope.verdict.verdict import level_reconcile


def _requests(level: int, tpots: list[float], warmup: int = 0) -> pd.DataFrame:
    rows = [{"level": level, "send_ns": 1_000 * i, "tpot_us": t, "warmup": i < warmup, "ok": True}
            for i, t in enumerate(tpots)]
    return pd.DataFrame(rows)


def test_the_quarters_are_the_first_and_last_timed_requests_in_the_order_sent():
    # 12 timed requests after 2 warm-up ones, sent in this order; the rows shuffled: order is send_ns's
    warm = [9_999.0, 9_999.0]
    tpots = warm + [1_000, 1_200, 1_100, 1_500, 1_500, 1_500, 1_500, 1_500, 1_500, 2_000, 2_400, 2_200]
    df = _requests(1, tpots, warmup=2).sample(frac=1.0, random_state=3)
    # quarter = 3 requests: first 1,000/1,200/1,100 -> 1,100; last 2,000/2,400/2,200 -> 2,200
    assert leveldrift.tpot_quarters(df) == {1: (1_100.0, 2_200.0)}


def test_failed_requests_and_small_levels_are_left_out():
    df = _requests(4, [1_000.0] * 7)  # 7 timed: under MIN_REQUESTS
    ok = _requests(8, [500.0, 500.0, 9_000.0, 700.0, 700.0, 700.0, 700.0, 900.0, 900.0])
    ok.loc[2, "ok"] = False  # the failed one is not a timed request
    # 8 timed: quarter 2 -> first 500/500 -> 500; last 900/900 -> 900
    assert leveldrift.tpot_quarters(pd.concat([df, ok])) == {8: (500.0, 900.0)}
    assert leveldrift.tpot_quarters(pd.DataFrame()) == {}


def test_a_miss_is_put_down_to_each_movement_measured_and_only_beyond_the_target():
    assert leveldrift.model_miss_causes(0.08, 0.30, 0.40, 0.20, 0.0) == ""  # within 10%: nothing to explain
    text = leveldrift.model_miss_causes(0.33, 0.18, 0.41, 0.18, 0.081, (1_540.0, 2_170.0))
    assert text == ("the engine's step moved +18% between 01 and 04; against that step the model is +8.1%; "
                    "the level's own TPOT moved +41% while it ran (1.54 ms in its first quarter, 2.17 ms in its "
                    "last); 04's two unprofiled runs a second apart differ by 18%")
    # movements of 10% or less are not causes: the miss stays unexplained, and says so
    assert leveldrift.model_miss_causes(-0.25, 0.05, -0.09, 0.02, -0.2) == \
        "no movement of the step measured: the model misses"
    assert ("concurrency 1 and 8, where the engine's step moved +25% (weighed as the model weighs them) from 01; "
            "against 01's step moved so, the model is +4.0%") in \
        leveldrift.model_miss_causes(0.30, None, 0.02, None, None, None, ([1, 8], 0.25))


def test_an_unprofiled_level_takes_the_drift_of_the_profiled_levels_around_it():
    drifts = {1: 0.18, 8: 0.32, 16: -0.14}
    # as the step model interpolates its inputs at batch 4: 4/7 of level 1's, 3/7 of level 8's
    assert leveldrift.bracketing_drift(drifts, 4) == ([1, 8], pytest.approx(0.18 * 4 / 7 + 0.32 * 3 / 7))
    assert leveldrift.bracketing_drift(drifts, 64) == ([16], -0.14)   # outside them: held at the nearest
    assert leveldrift.bracketing_drift({4: 0.2, 16: 0.0}, 1) == ([4], 0.2)
    assert leveldrift.bracketing_drift(drifts, 8) is None  # profiled: its own drift is read
    assert leveldrift.bracketing_drift({}, 4) is None


def test_the_verdicts_level_rows_carry_the_in_level_drift_and_the_miss():
    levels = pd.DataFrame([{"level": 1, "requests": 12, "tpot_p50_us": 1_500.0, "server_itl_mean_us": 1_500.0}])
    req = _requests(1, [1_000, 1_000, 1_000, 1_500, 1_500, 1_500, 1_500, 1_500, 1_500, 2_000, 2_000, 2_000])
    rows = level_reconcile(levels, {}, {1.0: (2_000.0, 1_800.0, 2_200.0)}, None, req)
    r = rows[0]
    assert (r["tpot_first_quarter_us"], r["tpot_last_quarter_us"]) == (1_000.0, 2_000.0)
    assert r["in_level_drift"] == 1.0 and abs(r["model_error"] - 1 / 3) < 1e-12
    assert r["model_miss"].startswith("the level's own TPOT moved +100% while it ran (1.00 ms")
    # without 01's requests: no in-level drift, and a miss nothing measured explains
    r = level_reconcile(levels, {}, {1.0: (2_000.0, 1_800.0, 2_200.0)})[0]
    assert "in_level_drift" not in r and r["model_miss"] == "no movement of the step measured: the model misses"


def test_an_engine_stall_is_named_where_the_model_misses_its_level():
    """On the H200, level 64 read TPOT 20.9 ms against a model of 5.7 ms (-72.9%): its streams had all stood
    still for 1.9 s at once (serving_levels' engine_stall_ms); the verdict names that, not a model miss."""
    import pandas as pd

    from decodescope.verdict.leveldrift import level_stalls, model_miss_causes, with_model_misses

    levels = pd.DataFrame({"level": [32, 64], "engine_stall_ms": [float("nan"), 1895.1]})
    assert level_stalls(levels) == {64: 1895.1} and level_stalls(levels.drop(columns="engine_stall_ms")) == {}
    said = model_miss_causes(-0.729, None, None, None, None, stall_ms=1895.1)
    assert said.startswith("an engine stall inside the level's window: every stream stood still for 1.9 s")
    rows = with_model_misses([{"level": 32, "model_error": -0.042}, {"level": 64, "model_error": -0.729}],
                             level_stalls(levels))
    assert rows[0]["model_miss"] == "" and "1.9 s" in rows[1]["model_miss"]
