""""What would move it": only what was measured is ranked; a fix with an assumed input is its break-even
condition; each projection sits beside its bound on the critical path."""
from decodescope.schema.records import ProjectionRow, Verdict
from decodescope.schema.records_critpath import CritPathFixRow
from decodescope.verdict.findings import _fix_findings
from decodescope.verdict.ranking import rank_projections


def projection(fix, gain_pct, status="priced"):
    return ProjectionRow(fix=fix, step_us=1.0, low_us=1.0, high_us=1.0, tokens_per_step=1.0, tpot_us=1000.0,
                         tpot_low_us=900.0, tpot_high_us=1100.0, gain_pct=gain_pct, assumptions="a", batch=1.0,
                         status=status)


def test_an_assumed_gain_is_not_ranked_but_stated_as_its_break_even_condition_beside_the_measured_one():
    projs = [projection("speculative decoding k=3, alpha=0.9", -65.0, "break-even"),
             projection("speculative decoding k=3, alpha=0.7", -52.0, "break-even"),
             projection("GEMMs 2x faster", -20.0), projection("speculative decoding k=5, self drafter", 40.0,
                                                               "measured")]
    ranked = [{"fix": "speculative decoding k=3 (drafter and acceptance not measured)", "status": "break-even",
               "text": "k=3 pays off at c1 only when the drafter costs under 900 us a pass; self drafter measured: "
                       "+40%, and that holds here"}]
    bounds = [CritPathFixRow(concurrency=4, bound="gemm (all) free", bound_gain_pct=10.0, bound_wall_us=1.0,
                             wall_us=1.0, fix="GEMMs 2x faster", projected_gain_pct=20.0, exceeds_bound=True),
              CritPathFixRow(concurrency=1, bound="gemm (all) free", bound_gain_pct=12.0, bound_wall_us=1.0,
                             wall_us=1.0, fix="GEMMs 2x faster", projected_gain_pct=20.0, exceeds_bound=True)]
    got = rank_projections(projs, ranked, bounds)
    assert [(p.fix, p.rank) for p in got] == [("GEMMs 2x faster", 1), ("speculative decoding k=5, self drafter", 2),
                                              ("speculative decoding k=3, alpha=0.9", None),
                                              ("speculative decoding k=3, alpha=0.7", None)]
    gemm = got[0]
    assert (gemm.bound, gemm.bound_gain_pct, gemm.beyond_bound) == ("gemm (all) free (c1)", 12.0, True)
    assert all(p.condition.startswith("k=3 pays off") for p in got[2:])
    text = [f["text"] for f in _fix_findings(Verdict(projections=got))]
    assert text[0].startswith("GEMMs 2x faster (priced): TPOT -20%") and "beyond it" in text[0]
    assert "Would not help: speculative decoding k=5, self drafter: +40%." in text
    # the two assumed acceptances share one condition: one sentence, the measured drafter's loss in it
    assumed = [t for t in text if t.startswith("Not ranked")]
    assert len(assumed) == 1 and "alpha=0.9; speculative decoding k=3, alpha=0.7" in assumed[0]
    assert "measured: +40%, and that holds here" in assumed[0]
    assert not any("-65%" in t or "-52%" in t for t in text)   # no assumed gain is shown as one
