"""The multi-GPU campaign's params (issue 46), prepared before a machine of two or more GPUs is lent: each file
loads, runs at its tensor-parallel size with the collective probe on as many ranks, and each variant resolves to
the server it names, down to the command line the server is started with."""
import json
import subprocess

import pytest

from decodescope.exec.serverlaunch import SELF_MODEL, launch_spec
from decodescope.schema.params import load_params, with_experiment

# file -> (tensor-parallel size, server cores, the sizes the verdict projects)
CAMPAIGN = {
    "h200x2-qwen3moe.yaml": (2, "0-15", [1]),
    "h200x4-kimi-int4.yaml": (4, "0-31", [1, 2]),
    "h200x8-kimi-int4.yaml": (8, "0-63", [1, 4]),
}
PCIE = {"h200x2-qwen3moe-pcie.yaml": 2, "h200x8-kimi-int4-pcie.yaml": 8}
VARIANTS = ["tp1", "ep", "no-custom-ar", "pcie-like", "spec-self-k3"]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _argv(params) -> list[str]:
    return launch_spec(params, "/models/m", "/models/m").argv


@pytest.mark.parametrize("name", sorted(CAMPAIGN) + sorted(PCIE))
def test_each_file_runs_at_its_size_with_the_probe_on_as_many_ranks_and_multicast_off(repo, name):
    p = load_params(repo / "params" / name)
    tp = CAMPAIGN[name][0] if name in CAMPAIGN else PCIE[name]
    assert p.server.tensor_parallel == tp and p.microbench.world_size == tp
    assert p.run_name == name.removesuffix(".yaml") and p.hardware.gpu == "H200"
    assert p.server.engine_args["load-format"] == "dummy" and p.model.tokenizer == "train" and p.model.path is None
    assert NO_MULTICAST.items() <= p.server.env.items()
    argv = _argv(p)
    assert argv[argv.index("--tensor-parallel-size") + 1] == str(tp)


@pytest.mark.parametrize("name", sorted(CAMPAIGN))
def test_the_variants_are_there_with_their_settings(repo, name):
    tp, cpus, projected = CAMPAIGN[name]
    p = load_params(repo / "params" / name)
    assert [e.name for e in p.experiments] == VARIANTS
    exp = {e.name: e for e in p.experiments}
    assert exp["tp1"].tensor_parallel == 1 and not exp["tp1"].engine_args and not exp["tp1"].env
    assert exp["ep"].engine_args == {"enable-expert-parallel": True} and exp["ep"].tensor_parallel is None
    assert exp["no-custom-ar"].engine_args == {"disable-custom-all-reduce": True} and not exp["no-custom-ar"].env
    assert exp["pcie-like"].engine_args == {"disable-custom-all-reduce": True}
    assert exp["pcie-like"].env == {"NCCL_P2P_DISABLE": "1"}
    spec = json.loads(exp["spec-self-k3"].engine_args["speculative-config"])
    assert spec == {"method": "draft_model", "model": SELF_MODEL, "num_speculative_tokens": 3}
    assert p.server.cpus == cpus and p.projected_tensor_parallel() == projected
    assert "NCCL_P2P_DISABLE" not in p.server.env and "disable-custom-all-reduce" not in p.server.engine_args


@pytest.mark.parametrize("name", sorted(CAMPAIGN))
def test_the_variants_resolve_to_the_servers_they_name(repo, name):
    tp = CAMPAIGN[name][0]
    p = load_params(repo / "params" / name)
    base_argv = _argv(p)
    assert "--enable-expert-parallel" not in base_argv and "--disable-custom-all-reduce" not in base_argv
    v = {n: with_experiment(p, n) for n in VARIANTS}
    for n, vp in v.items():
        assert vp.run_name == f"{p.run_name}+{n}" and vp.experiments == []
        assert vp.server.env.items() >= p.server.env.items()
        assert vp.server.engine_args.items() >= p.server.engine_args.items()   # the baseline's flags kept
    assert v["tp1"].server.tensor_parallel == 1 and v["tp1"].server.cpus == p.server.cpus
    assert all(v[n].server.tensor_parallel == tp for n in VARIANTS if n != "tp1")
    assert "--enable-expert-parallel" in _argv(v["ep"])
    assert "--disable-custom-all-reduce" in _argv(v["no-custom-ar"])
    pcie = v["pcie-like"]
    assert "--disable-custom-all-reduce" in _argv(pcie)
    assert launch_spec(pcie, "/models/m", "/models/m").env["NCCL_P2P_DISABLE"] == "1"
    argv = _argv(v["spec-self-k3"])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["model"] == "/models/m" and spec["num_speculative_tokens"] == 3   # "@model": the served dir
    levels = [1, 8, 64] if tp == 2 else [1, 16, 64]
    assert all(v[n].workload.concurrency == levels for n in VARIANTS)
    assert p.workload.concurrency == ([1, 2, 4, 8, 16, 32, 64] if tp == 2 else [1, 4, 16, 64])


@pytest.mark.parametrize("name", sorted(PCIE))
def test_the_pcie_baseline_and_its_nvlink_reverse(repo, name):
    """The PCIe setting as the baseline (so 03, 04 and the verdict are its own), the NVLink setting as the variant:
    P2P set back to "0" (not dropped: the campaign runs with NCCL_P2P_DISABLE=1 in its environment, which the
    server would inherit) and the custom all-reduce flag dropped."""
    p = load_params(repo / "params" / name)
    assert p.server.env["NCCL_P2P_DISABLE"] == "1" and p.server.engine_args["disable-custom-all-reduce"] is True
    assert "--disable-custom-all-reduce" in _argv(p)
    assert [e.name for e in p.experiments] == ["nvlink"]
    nv = with_experiment(p, "nvlink")
    assert nv.server.env["NCCL_P2P_DISABLE"] == "0" and "disable-custom-all-reduce" not in nv.server.engine_args
    assert "--disable-custom-all-reduce" not in _argv(nv)
    assert launch_spec(nv, "/models/m", "/models/m").env["NCCL_P2P_DISABLE"] == "0"
    twin = load_params(repo / "params" / name.replace("-pcie", ""))   # the same campaign but for the setting
    assert (p.model, p.workload, p.microbench, p.profile) == (twin.model, twin.workload, twin.microbench, twin.profile)


def test_the_device_procedure_parses_and_names_the_campaigns_params(repo):
    script = repo / "benchmarks/device/h200_campaign.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for name in list(CAMPAIGN) + list(PCIE):
        assert f"params/{name}" in text
    assert "NCCL_P2P_DISABLE=1 params/h200x2-qwen3moe-pcie.yaml" in text
