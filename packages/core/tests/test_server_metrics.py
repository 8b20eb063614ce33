"""kvik.bench.server_metrics: a Prometheus exposition's histograms, the difference of two scrapes,
and quantiles read from buckets as Prometheus' histogram_quantile reads them (by hand below)."""

from __future__ import annotations

import math

import pytest

from kvik.bench.server_metrics import comparison, parse_histograms, server_figures

BEFORE = """\
# HELP kvik:time_to_first_token_seconds Time to the first token.
# TYPE kvik:time_to_first_token_seconds histogram
kvik:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 1.0
kvik:time_to_first_token_seconds_bucket{le="0.02",model_name="m"} 1.0
kvik:time_to_first_token_seconds_bucket{le="0.04",model_name="m"} 2.0
kvik:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2.0
kvik:time_to_first_token_seconds_count{model_name="m"} 2.0
kvik:time_to_first_token_seconds_sum{model_name="m"} 0.04
kvik:num_requests_running{model_name="m"} 0.0
"""
# Ten more requests: 2 in (0, 10 ms], 4 in (10, 20], 3 in (20, 40], 1 above 40 ms.
AFTER = """\
kvik:time_to_first_token_seconds_bucket{le="0.01",model_name="m"} 3.0
kvik:time_to_first_token_seconds_bucket{le="0.02",model_name="m"} 7.0
kvik:time_to_first_token_seconds_bucket{le="0.04",model_name="m"} 11.0
kvik:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 12.0
kvik:time_to_first_token_seconds_count{model_name="m"} 12.0
kvik:time_to_first_token_seconds_sum{model_name="m"} 0.34
"""


def test_quantiles_of_the_run_between_two_scrapes() -> None:
    before, after = parse_histograms(BEFORE), parse_histograms(AFTER)
    assert set(before) == {"kvik:time_to_first_token_seconds"}  # gauges are not histograms
    run = after["kvik:time_to_first_token_seconds"].minus(
        before["kvik:time_to_first_token_seconds"]
    )
    assert run.buckets == {0.01: 2.0, 0.02: 6.0, 0.04: 9.0, math.inf: 10.0}
    assert (run.count, run.sum) == (10.0, pytest.approx(0.30))
    # Median: rank 5 of 10 lies in (10, 20] ms, which holds ranks 3..6: 10 + 10 * (5 - 2) / 4.
    assert run.quantile(0.5) == pytest.approx(0.0175)
    # p90: rank 9, the last of (20, 40] ms (ranks 7..9): its upper bound.
    assert run.quantile(0.9) == pytest.approx(0.04)
    # p99: rank 9.9 is in the +Inf bucket: the last finite bound, as Prometheus says.
    assert run.quantile(0.99) == pytest.approx(0.04)
    assert run.quantile(0.1) == pytest.approx(0.005)  # rank 1 of (0, 10]: from 0
    assert run.mean == pytest.approx(0.03)
    figures = server_figures(before, after)
    assert figures == {"ttft": {"count": 10.0, "mean_ms": 30.0, "median_ms": 17.5, "p99_ms": 40.0}}
    text = comparison({"median_ttft_ms": 17.5, "p99_ttft_ms": 44.0}, figures)
    assert "17.50 / 17.50 ms (1.000)" in text and "44.00 / 40.00 ms (1.100)" in text
    assert server_figures(None, after) is None
    empty = after["kvik:time_to_first_token_seconds"].minus(
        after["kvik:time_to_first_token_seconds"]
    )
    assert math.isnan(empty.quantile(0.5)) and math.isnan(empty.mean)
