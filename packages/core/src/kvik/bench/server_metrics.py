"""The server's side of a `kvik bench serve` run: its Prometheus latency histograms, scraped before
and after the run, and the median, p99 and mean of what it observed in between, to set beside what
the client measured.

Quantiles are read from the cumulative buckets as Prometheus' ``histogram_quantile`` reads them:
linearly within the bucket that holds the rank (from 0 for the first bucket), the last finite bound
for a rank in the ``+Inf`` bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The client's metric name -> the server's histogram (vLLM's names, under kvik's prefix).
SERVER_HISTOGRAMS = {
    "ttft": "kvik:time_to_first_token_seconds",
    "tpot": "kvik:request_time_per_output_token_seconds",
    "itl": "kvik:inter_token_latency_seconds",
    "e2el": "kvik:e2e_request_latency_seconds",
}


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    sum: float = 0.0
    count: float = 0.0

    def minus(self, before: Histogram | None) -> Histogram:
        """What was observed between ``before`` and this scrape."""
        if before is None:
            return self
        return Histogram(
            {le: n - before.buckets.get(le, 0.0) for le, n in self.buckets.items()},
            self.sum - before.sum,
            self.count - before.count,
        )

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1), NaN when the histogram is empty."""
        if self.count <= 0:
            return math.nan
        rank = q * self.count
        lower, below = 0.0, 0.0
        finite = [le for le in sorted(self.buckets) if math.isfinite(le)]
        for le in sorted(self.buckets):
            cumulative = self.buckets[le]
            if cumulative >= rank:
                if not math.isfinite(le):
                    return finite[-1] if finite else math.nan
                inside = cumulative - below
                if inside <= 0:
                    return le
                return lower + (le - lower) * (rank - below) / inside
            lower, below = le, cumulative
        return finite[-1] if finite else math.nan

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count > 0 else math.nan


def parse_histograms(text: str, prefix: str = "kvik:") -> dict[str, Histogram]:
    """The histograms of a Prometheus text exposition whose names start with ``prefix`` (one
    series each: kvik labels them only by model name)."""
    histograms: dict[str, Histogram] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                break
        else:
            continue
        histogram = histograms.setdefault(base, Histogram())
        if suffix == "_bucket":
            le = _label(labels, "le")
            if le is not None:
                histogram.buckets[float(le)] = float(value)
        elif suffix == "_sum":
            histogram.sum = float(value)
        else:
            histogram.count = float(value)
    return histograms


def _label(labels: str, key: str) -> str | None:
    for part in labels.rstrip("}").split(","):
        name, _, value = part.partition("=")
        if name.strip() == key:
            return value.strip().strip('"')
    return None


async def scrape(client: Any) -> dict[str, Histogram] | None:
    """The server's kvik histograms at /metrics, or None where it has none."""
    try:
        response = await client.get("/metrics")
    except Exception:
        return None
    if response.status_code != 200:
        return None
    histograms = parse_histograms(response.text)
    return histograms if SERVER_HISTOGRAMS["ttft"] in histograms else None


def server_figures(
    before: dict[str, Histogram] | None, after: dict[str, Histogram] | None
) -> dict[str, dict[str, float]] | None:
    """Per client metric: the server's count, mean, median and p99 (ms) over the run."""
    if before is None or after is None:
        return None
    figures = {}
    for metric, name in SERVER_HISTOGRAMS.items():
        if name not in after:
            continue
        run = after[name].minus(before.get(name))
        figures[metric] = {
            "count": run.count,
            "mean_ms": _ms(run.mean),
            "median_ms": _ms(run.quantile(0.5)),
            "p99_ms": _ms(run.quantile(0.99)),
        }
    return figures


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(1000 * seconds, 3)


def comparison(result: dict[str, Any], server: dict[str, dict[str, float]]) -> str:
    """Client and server side by side: median and p99 of each metric, and their ratio."""
    lines = ["metric   client median / server median (ratio)   client p99 / server p99 (ratio)"]
    for metric, figures in server.items():
        cells = []
        for stat in ("median", "p99"):
            mine, theirs = result.get(f"{stat}_{metric}_ms"), figures.get(f"{stat}_ms")
            ratio = f"{mine / theirs:.3f}" if mine and theirs else "-"
            cells.append(f"{_cell(mine)} / {_cell(theirs)} ms ({ratio})")
        lines.append(f"{metric.upper():5}    {cells[0]:38}  {cells[1]}")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
