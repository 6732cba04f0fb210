import pytest

from hpc.costmodel import Fabric, bus_bandwidth, flat_ring_seconds, hierarchical_seconds


def test_flat_ring_matches_its_closed_form():
    f = Fabric(nodes=4, gpus_per_node=2, rail_gbps=10.0, intra_gbps=100.0, alpha_inter_s=1.0, alpha_intra_s=0.5)
    # P = 8: 14 steps of alpha 1 s, and 2*7/8 * 80 bytes over 10 B/s.
    assert flat_ring_seconds(f, 80) == pytest.approx(14 * 1.0 + 2 * 7 / 8 * 80 / 10)


def test_hierarchical_matches_its_closed_form():
    f = Fabric(nodes=4, gpus_per_node=2, rail_gbps=10.0, intra_gbps=100.0, alpha_inter_s=1.0, alpha_intra_s=0.5)
    intra = 2 * 1 * 0.5 + 2 * (1 / 2) * 80 / 100
    inter = 2 * 3 * 1.0 + 2 * (3 / 4) * (80 / 2) / 10
    assert hierarchical_seconds(f, 80) == pytest.approx(intra + inter)


def test_degenerate_shapes_agree():
    one_gpu = Fabric(nodes=8, gpus_per_node=1, rail_gbps=5.0, intra_gbps=50.0)
    assert hierarchical_seconds(one_gpu, 1e6) == pytest.approx(flat_ring_seconds(one_gpu, 1e6))  # no intra-node part
    one_node = Fabric(nodes=1, gpus_per_node=8, rail_gbps=5.0, intra_gbps=50.0, alpha_intra_s=0.0)
    assert hierarchical_seconds(one_node, 8e6) == pytest.approx(flat_ring_seconds(one_node, 8e6))  # both: RS + AG in the node
    assert flat_ring_seconds(Fabric(1, 1, 1.0, 1.0), 1e9) == 0.0


def test_rail_aware_wins_by_about_g_for_large_messages():
    f = Fabric(nodes=128, gpus_per_node=8, rail_gbps=50e9, intra_gbps=450e9)
    size = 2**30
    speedup = flat_ring_seconds(f, size) / hierarchical_seconds(f, size)
    assert 4 < speedup < 8  # bounded by G = 8, reduced by the intra-node phases
    assert bus_bandwidth(f, size, hierarchical_seconds(f, size)) > 4 * bus_bandwidth(f, size, flat_ring_seconds(f, size))
