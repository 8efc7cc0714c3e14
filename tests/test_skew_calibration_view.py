"""05's methods section on the arrival skew: one sentence from 03's skew_calibration.json, saying whether
the run's skew figures hold and by how much, for a run that held, one that missed and one that did not check."""
from __future__ import annotations

import pytest
import yaml

from decodescope.report.critpath_view import skew_calibration_sentence, skew_calibration_table
from decodescope.schema.params import ParamsError, load_params
from decodescope.schema.records_critpath import SkewCalibration, SkewCalibrationRow


def row(injected_us: float, delivered_us: float, skew_us: float, recovered: bool,
        raw_abs_us: float | None = None) -> SkewCalibrationRow:
    return SkewCalibrationRow(
        cpu_path="native", communicator="vllm_shm", injected_us=injected_us, skew_rank=1, instances=40,
        late_rank_share=1.0, skew_us_median=skew_us, skew_us_p10=skew_us - 5, skew_us_p90=skew_us + 5,
        error_us=skew_us - injected_us, delivered_us=delivered_us, delivered_error_us=skew_us - delivered_us,
        recovered=recovered, raw_skew_us_median=skew_us, spin_us_median=delivered_us, transfer_us_median=2.0,
        raw_abs_skew_us_median=skew_us if raw_abs_us is None else raw_abs_us)


def test_a_run_whose_path_recovered_the_delay_says_its_skew_figures_hold_within_the_worst_error():
    rec = SkewCalibration(world=2, steps=4, ran=True, settings=[row(0, 0, 1.5, True), row(250, 258, 262, True)])
    s = skew_calibration_sentence(rec)
    assert "258 us ran (250 asked): 262 attributed" in s
    assert "hold within 4 us an instance" in s and "off by" not in s
    t = skew_calibration_table(rec)
    assert list(t["delay ran (us)"]) == [0, 258] and list(t["error (us)"]) == [1.5, 4.0]


def test_a_run_whose_path_missed_says_by_how_much_in_bold():
    rec = SkewCalibration(world=2, steps=4, ran=True, settings=[row(250, 220, 291, False, raw_abs_us=230)])
    s = skew_calibration_sentence(rec)
    assert "**the arrival skew figures of this report are off by up to 71 us an instance" in s


def test_a_busy_host_whose_own_lateness_swamped_the_delay_is_told_apart_from_a_wrong_path():
    """CI's loaded ssh run, 2026-12-06: 250 us asked, 260 ran, ranks preempted for 1-8 ms, 944 us attributed and
    944 off the ops: the path read the entries right; the delay was not what set them."""
    rec = SkewCalibration(world=2, steps=4, ran=True, settings=[row(0, 0, 3.5, True), row(250, 260.2, 943.7, False,
                                                                                             raw_abs_us=943.7)])
    s = skew_calibration_sentence(rec)
    assert "read the ranks' entries as they were (944 us off the ops" in s and "host's own lateness" in s
    assert "off by" not in s


def test_a_run_without_the_check_says_why():
    assert "one rank" in skew_calibration_sentence(SkewCalibration(world=1, steps=4, ran=False,
                                                                   why_not="one rank: no collective waits for another"))
    assert "not checked" in skew_calibration_sentence(None)


def test_a_negative_delay_is_refused_naming_the_field(tmp_path, repo):
    params = yaml.safe_load((repo / "params/default.yaml").read_text())
    params["microbench"]["skew_calibration_us"] = [250, -5]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError) as e:
        load_params(bad)
    assert "microbench.skew_calibration_us" in str(e.value) and "-5" in str(e.value)
