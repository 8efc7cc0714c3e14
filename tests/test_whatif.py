"""The verdict's one projection engine (decodescope.verdict.fixes): each fix is a whole step the step model predicts,
worked here by hand on the tiny Qwen3-MoE (4 MoE layers, hidden 256) at tensor-parallel 2."""
import pandas as pd
import pytest

from decodescope.model import arch as archmod
from decodescope.schema.params import load_params
from decodescope.schema.records import ProfileSummary, StepMedians
from decodescope.verdict import fixes
from decodescope.verdict import stepmodel as sm
from decodescope.verdict import stepparts as sp


@pytest.mark.parametrize("k, alpha, tokens", [(3, 0.6, (1 - 0.6 ** 4) / 0.4), (3, 0.0, 1.0), (4, 1.0, 5.0),
                                              (1, 0.5, 1.5)])
def test_expected_tokens_per_verify_step(k, alpha, tokens):
    assert fixes.expected_tokens_per_verify(k, alpha) == pytest.approx(tokens)


def test_acceptance_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="alpha must be in"):
        fixes.expected_tokens_per_verify(3, 1.2)


@pytest.fixture(scope="module")
def params(repo):
    return load_params(repo / "params/default.yaml")


@pytest.fixture(scope="module")
def inputs(params):
    """GEMMs at 10 us x batch per call (02), the engine's all-reduce flat at 5 us and all-to-all at 7 us
    (03), and a profiled step (04) of 100 us attention and 1,000 us between steps."""
    arch = archmod.normalize_config(params.model_config_dict())
    gemm = pd.DataFrame([{"op": s.op, "batch": b, "dtype": "bf16", "status": "ok", "time_us": 10.0 * b}
                         for b in (1, 2, 4, 8) for s in archmod.gemm_shapes(arch, 2, b)])
    sweep = [{"part": "sweep", "status": "ok", "op": "all_reduce", "communicator": "vllm_shm",
              "timing": "back_to_back", "inplace": True, "rank": 0, "bytes": n, "time_us": 5.0, "p10_us": 5.0,
              "p90_us": 5.0} for n in (256, 65536)]
    a2a = [{"part": "all_to_all", "status": "ok", "op": "all_to_all", "communicator": "vllm_shm", "rank": 0,
            "tokens_per_gpu": t, "time_us": 7.0, "p10_us": 7.0, "p90_us": 7.0} for t in (8, 64)]
    cats = [{"rank": 0, "category": c, "calls_per_step": 1.0, "calls_min": 1, "calls_max": 1, "time_per_step_us": t,
             "steps": 10} for c, t in (("allreduce", 1.0), ("attention", 100.0))]
    summary = ProfileSummary(device="cpu", ranks=[0], step_kind="decode", steps={}, concurrency=1,
                             allreduce_share_of_time={}, allreduce_calls_per_step={}, allreduce_mean_us={},
                             other_share=0.0, per_step=StepMedians(
                                 wall_us_median=1000.0, period_us_median=2101.0, idle_us_median=0.0,
                                 between_steps_us_median=1000.0, batch_median=1.0, summed_us_median=1.0,
                                 busy_us_median=1.0), per_step_categories=cats)
    samples = sm.step_samples({1: summary}, 40.0)
    return fixes.ModelInputs(gemm=gemm, gemm_tp=None, coll=pd.DataFrame(sweep + a2a), arch=arch, tp=2,
                             communicator="vllm_shm", timing="back_to_back", samples=samples,
                             serving_context_tokens=40.0)


def _part(pred, name: str) -> float:
    return next(c.us for c in pred.components if c.name == name)


def test_speculative_decoding_is_the_model_at_the_grown_batch_over_the_expected_tokens(inputs, params):
    by = {f.name: f for f in fixes.fixes_at(inputs, 1.0, params)}
    spec = by["speculative decoding k=1, alpha=0.5"]
    assert spec.tokens_per_step == pytest.approx(1.5)
    # the verify step decodes 2 tokens a sequence: every GEMM call 10 -> 20 us, the collectives flat at 5 us
    base, verify = inputs.predict(1.0), spec.prediction
    n_gemm = sum(s.count for s in archmod.gemm_shapes(inputs.arch, 2, 1))
    assert _part(verify, "gemm") - _part(base, "gemm") == pytest.approx(n_gemm * 10.0)
    assert _part(verify, "collectives") == pytest.approx(_part(base, "collectives"))
    assert verify.period_us == pytest.approx(inputs.predict(2.0).period_us)


def test_an_allreduce_latency_and_expert_parallelism_replace_only_the_collectives(inputs, params):
    schedule = archmod.collective_schedule(inputs.arch, 2, 1)
    n_ar = sum(c.count for c in schedule if c.op == "all_reduce")
    moe = inputs.arch.moe_layers
    assert (n_ar, moe) == (1 + 4 + 4, 4)            # embedding, 4 attention, 4 MoE
    base = inputs.predict(1.0)
    given = 2.5
    by = {f.name: f for f in fixes.fixes_at(inputs, 1.0, params.model_copy(update={
        "whatif": params.whatif.model_copy(update={"allreduce_us": [given]})}))}
    lat = by["all-reduce at 2.5 us per call"].prediction
    assert _part(lat, "collectives") == pytest.approx(n_ar * given)
    ep = by["expert parallelism"].prediction
    # the four MoE all-reduces (5 us) out, 2 x 4 all-to-all (7 us) in; the rest (5 all-reduces and the
    # logits all-gather, 5 us each) as measured
    assert _part(ep, "collectives") == pytest.approx(_part(base, "collectives") - moe * 5.0 + 2 * moe * 7.0)
    for f in (lat, ep):
        assert f.period_us - _part(f, "collectives") == pytest.approx(base.period_us - _part(base, "collectives"))


def test_a_run_whose_step_model_cannot_run_has_no_projection_and_says_why(tmp_path, repo, params):
    """The fallback that priced fixes on the profiled step alone is gone: without 02 nothing is projected."""
    import shutil

    from decodescope.verdict.verdict import verdict

    run = tmp_path / "run"
    shutil.copytree(repo / "tests/fixtures/runs/vllm_gpu_h200_qwen3moe", run)
    whole = verdict(run, load_params(repo / "params/h200-qwen3moe.yaml"))
    assert whole.projections and "the step model" in whole.sources["projections"]
    (run / "data/gemm.parquet").unlink()
    v = verdict(run, load_params(repo / "params/h200-qwen3moe.yaml"))
    assert v.projections == [] and v.curves == []
    assert "02's GEMMs (gemm.parquet)" in v.sources["projections"]


def test_a_batch_cap_is_the_step_at_the_cap_calibrated_by_the_baseline_measured_there(inputs):
    from decodescope.verdict.variants import _calibration

    fix = fixes.capped_fix(inputs, 8.0, 4)
    assert fix.prediction.period_us == pytest.approx(inputs.predict(4.0).period_us) and fix.calibrate_at == 4.0
    base = {4: 3_000.0, 8: 5_000.0}
    scale, how = _calibration(inputs, fix, 8.0, base, base)
    # the capped level's token costs what the baseline measured at batch 4, not level 8's TPOT x model ratio
    assert fix.prediction.period_us * scale == pytest.approx(3_000.0)
    assert how == "calibrated by the baseline's TPOT at level 4, the batch it runs at"
    below = fixes.capped_fix(inputs, 2.0, 4)     # a level under the cap: the plain step, its own calibration
    assert below.calibrate_at == 2.0 and below.prediction.period_us == pytest.approx(inputs.predict(2.0).period_us)


def test_an_eager_step_is_the_host_issuing_the_profiled_kernels_at_02s_cost_per_call(inputs):
    from dataclasses import replace

    from decodescope.verdict.variants import _calibration, _implied_host_per_kernel

    assert fixes.eager_fix(inputs, 1.0) == (None, "02 measured no host cost per call (it does on a GPU)")
    gemm = inputs.gemm.assign(host_time_us=20.0, host_p10_us=18.0, host_p90_us=25.0)
    inp = replace(inputs, gemm=gemm, samples=[replace(s, kernels_per_step=100.0) for s in inputs.samples])
    fix, why = fixes.eager_fix(inp, 1.0)
    assert why == "" and not fix.calibrated
    base = inp.predict(1.0)
    gpu_us = sum(c.us for c in base.components if c.kind is sp.Kind.WORK) * base.overlap
    between = _part(base, "between steps")
    assert between == pytest.approx(1_000.0)
    # GPU time per kernel under the host's 20 us: the host sets the pace, and the last kernel ends the step
    assert gpu_us / 100 < 18.0
    assert _part(fix.prediction, fixes.EAGER_STEP) == pytest.approx(100 * 20.0 + gpu_us / 100)
    assert fix.prediction.period_us == pytest.approx(100 * 20.0 + gpu_us / 100 + 1_000.0)
    assert fix.prediction.band_us == (pytest.approx(100 * 18.0 + gpu_us / 100 + 1_000.0),
                                      pytest.approx(100 * 25.0 + gpu_us / 100 + 1_000.0))
    assert _calibration(inp, fix, 1.0, {1: 2_000.0}, {1: 2_000.0})[0] == 1.0     # the model's own value
    # measured 11,000 us a token: (11,000 - 1,000) / 100 kernels = 100 us of host time per kernel
    assert "implies 100.0 us of host time per profiled kernel" in _implied_host_per_kernel(fix, 11_000.0)
    assert fixes.eager_fix(replace(inp, samples=[replace(s, kernels_per_step=0.0) for s in inp.samples]), 1.0) == \
        (None, "04 counted no kernels per step")


def test_each_variant_is_routed_to_the_fix_that_projects_its_change(inputs, params):
    from dataclasses import replace

    from decodescope.schema.params import with_experiment
    from decodescope.verdict.variants import variant_fix

    inp = replace(inputs, gemm=inputs.gemm.assign(host_time_us=20.0, host_p10_us=18.0, host_p90_us=25.0),
                  samples=[replace(s, kernels_per_step=100.0) for s in inputs.samples])
    p = params.model_copy(update={"experiments": []})
    cases = {"seqs": ({"max-num-seqs": 4}, "max-num-seqs 4: the step at batch 4"),
             "eager": ({"enforce-eager": True}, "eager: no CUDA graphs, no torch.compile")}
    for name, (args, projection) in cases.items():
        exp = p.model_validate({**p.model_dump(), "experiments": [{"name": name, "engine_args": args}]})
        fix, why = variant_fix(inp, exp, with_experiment(exp, name), exp.experiments[0], 8.0, (None, False))
        assert why == "" and fix.name == projection
    same = p.model_validate({**p.model_dump(), "experiments": [{"name": "same", "engine_args": {"seed": 1}}]})
    assert variant_fix(inp, same, with_experiment(same, "same"), same.experiments[0], 8.0, (None, False)) == \
        (None, "no projection for this change")
