from decodescope.exec.hardware import (classify_link, interconnect_summary, known_peaks, parse_topo_matrix,
                                       resolve_peaks)


def test_pcie_box_pairs_are_classified(repo):
    text = (repo / "tests/fixtures/topo/pcie_8gpu_dual_socket.txt").read_text()
    pairs = parse_topo_matrix(text)
    assert len(pairs) == 64
    link = {(r.gpu_a, r.gpu_b): r.link_class for r in pairs.itertuples()}
    assert link[(0, 1)] == "pcie_switch"    # PIX
    assert link[(6, 7)] == "pcie_switch"    # PXB
    assert link[(0, 2)] == "host_bridge"    # NODE
    assert link[(0, 4)] == "cross_socket"   # SYS
    assert link[(3, 3)] == "self"
    assert interconnect_summary(pairs) == "pcie"
    assert not (pairs.link_class == "nvlink").any()


def test_nvlink_box_pairs_are_nvlink_and_nics_ignored(repo):
    text = (repo / "tests/fixtures/topo/nvlink_8gpu_dgx_h100.txt").read_text()
    pairs = parse_topo_matrix(text)
    assert set(pairs.gpu_b) == set(range(8))
    off = pairs[pairs.gpu_a != pairs.gpu_b]
    assert (off.link_class == "nvlink").all() and (off.nvlinks == 18).all()
    assert interconnect_summary(pairs) == "nvlink"


def test_classify_codes():
    assert classify_link("NV4") == "nvlink"
    assert classify_link("PHB") == "host_bridge"
    assert classify_link("???") == "unknown"


def test_known_gpu_names_map_to_peaks():
    assert known_peaks("NVIDIA H200").name == "H200"
    assert known_peaks("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert known_peaks("NVIDIA RTX PRO 6000 Blackwell Server Edition").name == "RTX PRO 6000 Blackwell"
    assert known_peaks("NVIDIA A100-SXM4-80GB").name == "A100 SXM"
    assert known_peaks("Some Future GPU") is None


def test_params_peaks_override_known_ones():
    peaks = resolve_peaks("NVIDIA H200", {"mem_gbps": 4000.0, "bf16_tflops": None})
    assert peaks.mem_gbps == 4000.0 and peaks.bf16_tflops == 989.0
    assert "override" in peaks.source
    assert resolve_peaks(None, {}) is None


def test_real_h200_machines(repo):
    one = parse_topo_matrix((repo / "tests/fixtures/topo/h200_1gpu_real.txt").read_text())
    assert len(one) == 1 and one.iloc[0]["link_class"] == "self"
    assert interconnect_summary(one) == "single"
    two = parse_topo_matrix((repo / "tests/fixtures/topo/h200x2_nvlink_real.txt").read_text())  # ANSI header
    pair = two[(two.gpu_a == 0) & (two.gpu_b == 1)].iloc[0]
    assert pair["link_class"] == "nvlink" and pair["nvlinks"] == 18
    assert interconnect_summary(two) == "nvlink"
