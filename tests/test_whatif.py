"""Each what-if on the campaign's own figures (Kimi-K2.5 INT4, TP=8, eight PCIe GPUs): wall step 12.1 ms,
summed kernel time 21.7 ms, 122 all-reduces of 14,336 B at ~78 us each in the profile (~56 us alone),
against numbers worked by hand here."""
import pytest

from decodescope.verdict import whatif as wi

CAMPAIGN = wi.MeasuredStep(wall_us=12_100.0, summed_us=21_700.0, allreduce_calls=122, allreduce_us_per_call=78.0)


def test_overlap_factor_is_wall_over_summed():
    assert CAMPAIGN.overlap_factor == pytest.approx(12.1 / 21.7)  # 0.5576


def test_allreduce_at_its_isolated_latency():
    p = wi.allreduce_latency(CAMPAIGN, 56.0, "NCCL alone, 03")
    # 122 x (78 - 56) = 2,684 us of serial work saved; x 0.5576 = 1,496.6 us on the wall-clock step
    assert p.step_us == pytest.approx(12_100 - 2_684 * 12.1 / 21.7)          # 10,603.4 us
    assert (p.low_us, p.high_us) == (pytest.approx(12_100 - 2_684), pytest.approx(p.step_us))
    assert p.gain == pytest.approx(-1_496.6 / 12_100, rel=1e-4)              # -12.4%
    assert any("122 all-reduces" in a for a in p.assumptions)


def test_allreduce_in_a_cuda_graph_custom_all_reduce():
    p = wi.allreduce_latency(CAMPAIGN, 22.0, "CUDA graph")
    assert p.step_us == pytest.approx(12_100 - 122 * 56 * 12.1 / 21.7)       # 8,290.4 us
    assert p.low_us == pytest.approx(12_100 - 6_832)                          # 5,268 us if all on the path


def test_expert_parallelism_loses_when_two_all_to_alls_cost_more_than_the_all_reduce():
    p = wi.expert_parallel(CAMPAIGN, moe_layers=60, all_to_all_us=40.0)
    # per MoE layer: 78 us out, 2 x 40 = 80 us in: 60 x -2 = -120 us saved (a loss)
    assert p.step_us == pytest.approx(12_100 + 120 * 12.1 / 21.7)            # 12,166.9 us
    assert p.gain > 0
    assert wi.expert_parallel(CAMPAIGN, 60, 20.0).step_us == pytest.approx(12_100 - 60 * 38 * 12.1 / 21.7)


@pytest.mark.parametrize("k, alpha, tokens", [(3, 0.6, (1 - 0.6 ** 4) / 0.4), (3, 0.0, 1.0), (4, 1.0, 5.0),
                                              (1, 0.5, 1.5)])
def test_expected_tokens_per_verify_step(k, alpha, tokens):
    assert wi.expected_tokens_per_verify(k, alpha) == pytest.approx(tokens)


def test_speculative_decoding_divides_the_verify_step_by_the_expected_tokens():
    # verify step at batch x 4: say 13.0 ms (GEMMs grow, the 122 all-reduces do not); n-gram draft ~0
    p = wi.speculative(CAMPAIGN, k=3, alpha=0.6, verify_step_us=13_000.0)
    assert p.tokens_per_step == pytest.approx(2.176)
    assert p.tpot_us == pytest.approx(13_000 / 2.176)                        # 5,974.3 us
    assert p.gain == pytest.approx(13_000 / 2.176 / 12_100 - 1)               # -50.6%
    # with a draft model costing 2 ms per verify step
    assert wi.speculative(CAMPAIGN, 3, 0.6, 13_000.0, draft_us=2_000.0).tpot_us == pytest.approx(15_000 / 2.176)
    # nothing accepted: the verify step is pure cost
    assert wi.speculative(CAMPAIGN, 3, 0.0, 13_000.0).gain == pytest.approx(13_000 / 12_100 - 1)


def test_acceptance_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="alpha must be in"):
        wi.expected_tokens_per_verify(3, 1.2)


def test_measured_projections_price_each_communicator_the_probe_measured(repo):
    import pandas as pd

    from decodescope.model import arch as archmod
    from decodescope.schema.params import load_params

    arch = archmod.normalize_config(load_params(repo / "params/default.yaml").model_config_dict())
    step = wi.MeasuredStep(wall_us=1_000.0, summed_us=1_500.0, allreduce_calls=9, allreduce_us_per_call=20.0, batch=4)
    sweep = [{"part": "sweep", "status": "ok", "op": "all_reduce", "communicator": comm, "timing": "back_to_back",
              "inplace": True, "rank": 0, "bytes": n, "time_us": t, "p10_us": t, "p90_us": t}
             for comm, t in (("vllm_shm", 5.0), ("torch_gloo", 1_000.0)) for n in (1024, 2048, 4096, 8192)]
    coll = pd.DataFrame(sweep)
    gemm = pd.DataFrame([{"op": s.op, "batch": b, "dtype": "bf16", "status": "ok", "time_us": 1.0 * b}
                         for s in archmod.gemm_shapes(arch, 2, 4) for b in (4, 8, 16)])
    proj = {p.name: p for p in wi.measured_projections(step, coll, gemm, arch, 2, "vllm_shm", spec_k=(1,),
                                                        spec_alpha=(0.5,))}
    shm = proj["all-reduce at 5.0 us per call (vllm_shm, 03 back_to_back)"]
    assert shm.step_us == pytest.approx(1_000 - 9 * 15 * 1_000 / 1_500)      # 910 us
    gloo = proj["all-reduce at 1000.0 us per call (torch_gloo, 03 back_to_back)"]
    assert gloo.step_us == pytest.approx(1_000 + 9 * 980 * 1_000 / 1_500)    # 6,880 us: slower
    spec = proj["speculative decoding k=1, alpha=0.50"]
    # verify at batch 8: every GEMM of the step 4 us -> 8 us per call, collectives flat at 5 us
    n_gemm = sum(s.count for s in archmod.gemm_shapes(arch, 2, 4))
    assert spec.step_us == pytest.approx(1_000 + n_gemm * (8.0 - 4.0))
    assert spec.tpot_us == pytest.approx(spec.step_us / 1.5)
    rows = wi.projection_rows(list(proj.values()))
    assert [r["gain_pct"] for r in rows] == sorted(r["gain_pct"] for r in rows)  # ranked, best first


def test_the_projection_bars_of_a_run_without_a_profiled_step_draw_no_step_line():
    """On the H200 a run whose server never started (01 and 04 failed) still priced fixes through the step
    model; its 05 failed on the missing measured step (None / 1e3) instead of showing them."""
    import pandas as pd

    from decodescope.report.plots import projection_bars

    proj = pd.DataFrame([{"fix": "spec-ngram", "tpot_us": 1800.0, "tpot_low_us": 1700.0, "tpot_high_us": 1900.0,
                          "gain_pct": -10.0, "assumptions": "k=3"}])
    assert [s.type for s in projection_bars(proj, 2000.0).layout.shapes] == ["line"]
    assert projection_bars(proj, None).layout.shapes == ()
