"""benchmarks.ettr's model: the best interval is Young's where the save is small beside the MTBF,
a costlier restart never raises the ratio, and the failure rate is Llama 3's."""

from __future__ import annotations

import math

import pytest

from benchmarks.ettr import GPU_COUNTS, Path_, best_interval, ettr, mtbf_s, table, young_s


def test_the_failure_rate_is_llama_3s_and_scales_with_the_gpu_count():
    assert mtbf_s(16384) / 3600 == pytest.approx(54 * 24 / 419)
    assert mtbf_s(1024) == pytest.approx(16 * mtbf_s(16384))


def test_the_best_interval_is_youngs_for_a_small_save_and_beats_its_neighbours():
    mtbf = mtbf_s(16384)
    interval, ratio = best_interval(save_s=1.0, restart_s=6.0, mtbf=mtbf)
    assert interval == pytest.approx(young_s(1.0, mtbf), rel=0.02)
    assert ratio >= max(ettr(interval * f, 1.0, 6.0, mtbf) for f in (0.5, 0.9, 1.1, 2.0))
    assert ratio == pytest.approx((1 - 1 / interval) * (1 - (6 + interval / 2) / mtbf), abs=2e-3)


def test_a_costlier_restart_or_save_never_raises_the_ratio():
    for gpus in GPU_COUNTS:
        mtbf = mtbf_s(gpus)
        ratios = [best_interval(1.0, restart, mtbf)[1] for restart in (0, 6, 30, 150)]
        assert ratios == sorted(ratios, reverse=True) and all(0 < r < 1 for r in ratios)
        assert best_interval(10.0, 6.0, mtbf)[1] < best_interval(1.0, 6.0, mtbf)[1]
    assert ettr(60.0, 1.0, 1e9, mtbf_s(1024)) == 0.0  # a restart longer than the MTBF: nothing trains


def test_the_table_has_a_row_per_gpu_count_and_a_column_per_path():
    lines = table([Path_("spare", 6.0), Path_("requeue", 150.0)], save_s=1.0, scale_up_s=0.0)
    assert len(lines) == 2 + len(GPU_COUNTS) and all(line.count("|") == 5 for line in lines)
    assert "| 16,384 | 3.09 h |" in lines[2 + GPU_COUNTS.index(16384)] and not math.isnan(mtbf_s(1))
