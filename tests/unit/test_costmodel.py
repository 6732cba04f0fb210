"""The alpha-beta model checked against numbers worked by hand, its limits, monotonicity and the
ratio claims docs/benchmarks.md makes; never against its own formulas typed again."""

import itertools

import pytest

from hpc.fabric.costmodel import Fabric, bus_bandwidth, flat_ring_seconds, hierarchical_seconds, render_table

# 4 nodes x 2 GPUs (P = 8), rail 10 B/s, intra-node 100 B/s, alpha 1 s between nodes, 0.5 s inside.
SMALL = Fabric(nodes=4, gpus_per_node=2, rail_gbps=10.0, intra_gbps=100.0, alpha_inter_s=1.0, alpha_intra_s=0.5)
# docs/benchmarks.md: 128 nodes x 8 GPUs, 50 GB/s per rail, 450 GB/s NVLink, alpha 5 us / 2 us.
DGX_POD = Fabric(nodes=128, gpus_per_node=8, rail_gbps=50e9, intra_gbps=450e9)
GIB = 2**30


def test_small_cluster_worked_by_hand():
    # Flat ring: 14 steps (7 reduce-scatter + 7 allgather) over the rail, each 1 s + 10 bytes / 10 B/s.
    assert flat_ring_seconds(SMALL, 80) == pytest.approx(28.0)
    # Hierarchical: in the node 2 steps of 0.5 s + 40 bytes / 100 B/s = 1.8 s; across nodes, on
    # 40 bytes per rail, 6 steps of 1 s + 10 bytes / 10 B/s = 12 s.
    assert hierarchical_seconds(SMALL, 80) == pytest.approx(13.8)
    # busbw = 80 bytes / 28 s x 2 x 7/8 = 5 B/s.
    assert bus_bandwidth(SMALL, 80, 28.0) == pytest.approx(5.0)
    assert bus_bandwidth(SMALL, 80, 0.0) == 0.0


def test_the_published_dgx_pod_figures_worked_by_hand():
    # 1 GiB: flat 2046 x 5 us + 2 x 1023/1024 x 1 GiB / 50 GB/s = 10.23 ms + 42.91 ms.
    assert flat_ring_seconds(DGX_POD, GIB) * 1e3 == pytest.approx(53.138, abs=1e-3)
    # hierarchical: 14 x 2 us + 2 x 7/8 x 1 GiB / 450 GB/s (4.176 ms), then
    # 254 x 5 us + 2 x 127/128 x 128 MiB / 50 GB/s (5.327 ms).
    assert hierarchical_seconds(DGX_POD, GIB) * 1e3 == pytest.approx(10.800, abs=1e-3)
    assert "| 1024 MiB | 53.138 | 10.800 | 40.4 | 198.6 | 4.92x |" in render_table(DGX_POD, [GIB])


def test_empty_messages_cost_only_latency():
    assert flat_ring_seconds(SMALL, 0) == pytest.approx(14.0)  # 2(P-1) inter-node alphas
    assert hierarchical_seconds(SMALL, 0) == pytest.approx(1.0 + 6.0)  # 2(G-1) intra + 2(N-1) inter
    # docs: up to G at 1 MiB, where latency dominates: 10.23 ms against 0.028 + 1.27 ms.
    assert flat_ring_seconds(DGX_POD, 0) / hierarchical_seconds(DGX_POD, 0) == pytest.approx(10.23 / 1.298, rel=1e-3)


def test_large_messages_cost_bandwidth_per_byte():
    def per_byte(model):
        return (model(SMALL, 2e12) - model(SMALL, 1e12)) / 1e12

    assert per_byte(flat_ring_seconds) == pytest.approx(2 * 7 / 8 / 10)  # 0.175 s/B
    assert per_byte(hierarchical_seconds) == pytest.approx(0.01 + 0.075)  # node phases + rail phase


def test_degenerate_shapes_agree():
    one_gpu = Fabric(nodes=8, gpus_per_node=1, rail_gbps=5.0, intra_gbps=50.0)
    assert hierarchical_seconds(one_gpu, 1e6) == pytest.approx(flat_ring_seconds(one_gpu, 1e6))  # no intra-node part
    one_node = Fabric(nodes=1, gpus_per_node=8, rail_gbps=5.0, intra_gbps=50.0, alpha_intra_s=0.0)
    assert hierarchical_seconds(one_node, 8e6) == pytest.approx(flat_ring_seconds(one_node, 8e6))  # both: RS + AG in the node
    assert flat_ring_seconds(one_node, 8e6) == pytest.approx(2 * 7 / 8 * 8e6 / 50.0)  # intra links, not the rail
    assert flat_ring_seconds(Fabric(1, 1, 1.0, 1.0), 1e9) == 0.0
    assert hierarchical_seconds(Fabric(1, 1, 1.0, 1.0), 1e9) == 0.0


@pytest.mark.parametrize("model", [flat_ring_seconds, hierarchical_seconds])
def test_more_bytes_or_latency_cost_more_and_more_bandwidth_costs_less(model):
    shapes = [Fabric(n, g, 10.0, 100.0, 1.0, 0.5) for n, g in itertools.product((2, 3, 8), (1, 2, 8))]
    for f in shapes:
        times = [model(f, n) for n in (0, 1, 1e3, 1e6)]
        assert times == sorted(times) and times[0] < times[-1], f
        assert model(Fabric(f.nodes, f.gpus_per_node, 20.0, 100.0, 1.0, 0.5), 1e6) < model(f, 1e6)
        assert model(Fabric(f.nodes, f.gpus_per_node, 10.0, 100.0, 2.0, 0.5), 1e6) > model(f, 1e6)
        if f.gpus_per_node > 1:  # the intra-node links matter to the hierarchical one only
            faster_nvlink = model(Fabric(f.nodes, f.gpus_per_node, 10.0, 200.0, 1.0, 0.5), 1e6)
            assert faster_nvlink < model(f, 1e6) if model is hierarchical_seconds else faster_nvlink == model(f, 1e6)


def test_a_latency_free_flat_ring_runs_at_the_rail_bandwidth():
    """nccl-tests' busbw is defined so that a bandwidth-bound ring shows the link's rate."""
    for nodes, gpus in [(2, 1), (4, 2), (16, 8)]:
        f = Fabric(nodes, gpus, rail_gbps=10.0, intra_gbps=100.0, alpha_inter_s=0.0, alpha_intra_s=0.0)
        assert bus_bandwidth(f, 1e6, flat_ring_seconds(f, 1e6)) == pytest.approx(10.0)


def test_rail_aware_wins_by_g_when_nvlink_and_latency_are_free():
    # Only the rail phase is left: n/G bytes over N ranks against n bytes over P = N*G ranks,
    # speedup G x (P-1)/P x N/(N-1): 2 nodes x 2 GPUs gives 2 x 3/4 x 2 = 3.
    def free(nodes, gpus):
        return Fabric(nodes, gpus, rail_gbps=10.0, intra_gbps=float("inf"), alpha_inter_s=0.0, alpha_intra_s=0.0)

    assert flat_ring_seconds(free(2, 2), 1e6) / hierarchical_seconds(free(2, 2), 1e6) == pytest.approx(3.0)
    assert flat_ring_seconds(free(1024, 8), 1e6) / hierarchical_seconds(free(1024, 8), 1e6) == pytest.approx(8.0, rel=2e-3)


def test_rail_aware_wins_by_up_to_g_on_the_published_pod():
    speedups = [flat_ring_seconds(DGX_POD, n) / hierarchical_seconds(DGX_POD, n) for n in (2**20, 16 * 2**20, 256 * 2**20, GIB)]
    assert speedups == sorted(speedups, reverse=True)  # the NVLink phases weigh more as messages grow
    assert 7.8 < speedups[0] < 8 and 4.9 < speedups[-1] < 5  # docs: 7.9x at 1 MiB, 4.9x at 1 GiB
    flat_bus, hier_bus = (bus_bandwidth(DGX_POD, GIB, model(DGX_POD, GIB)) for model in (flat_ring_seconds, hierarchical_seconds))
    assert flat_bus < DGX_POD.rail_gbps < hier_bus < DGX_POD.gpus_per_node * DGX_POD.rail_gbps
