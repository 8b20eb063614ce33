"""The server's side of a `kvik bench serve` run: its Prometheus latency histograms, scraped before
and after the run, and the median, p99 and mean of what it observed in between, to set beside what
the client measured; and, where it speculates, its draft acceptance over the run.

Quantiles are read from the cumulative buckets as Prometheus' ``histogram_quantile`` reads them:
linearly within the bucket that holds the rank (from 0 for the first bucket), the last finite bound
for a rank in the ``+Inf`` bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvik.spec_decode.metrics import (
    NUM_ACCEPTED_TOKENS,
    NUM_ACCEPTED_TOKENS_PER_POS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    SpecDecodingStats,
)

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


def parse_spec_decoding(text: str) -> SpecDecodingStats | None:
    """The speculative decoding counters of an exposition (vLLM's names, kvik's prefix), or None
    where the server does not speculate."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("kvik:spec_decode_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if not name.endswith("_total"):  # prometheus_client's *_created lines
            continue
        name = name.removesuffix("_total")
        if name == NUM_ACCEPTED_TOKENS_PER_POS:
            position = _label(labels, "position")
            if position is not None:
                per_pos[int(position)] = float(value)
        else:
            totals[name] = float(value)
    if NUM_DRAFTS not in totals or not per_pos:
        return None
    return SpecDecodingStats(
        num_spec_tokens=max(per_pos) + 1,
        num_drafts=int(totals[NUM_DRAFTS]),
        num_draft_tokens=int(totals.get(NUM_DRAFT_TOKENS, 0)),
        num_accepted_tokens=int(totals.get(NUM_ACCEPTED_TOKENS, 0)),
        num_accepted_tokens_per_pos=[int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)],
    )


@dataclass
class Scrape:
    """What a kvik server's /metrics said at one moment."""

    histograms: dict[str, Histogram]
    spec_decoding: SpecDecodingStats | None


async def scrape(client: Any) -> Scrape | None:
    """The server's kvik histograms and speculative decoding counters at /metrics, or None where
    it has no kvik histograms."""
    try:
        response = await client.get("/metrics")
    except Exception:
        return None
    if response.status_code != 200:
        return None
    histograms = parse_histograms(response.text)
    if SERVER_HISTOGRAMS["ttft"] not in histograms:
        return None
    return Scrape(histograms, parse_spec_decoding(response.text))


def spec_decoding_between(before: Scrape | None, after: Scrape | None) -> SpecDecodingStats | None:
    """The server's acceptance counts over the run (None where it does not speculate)."""
    if before is None or after is None or after.spec_decoding is None:
        return None
    return after.spec_decoding.minus(before.spec_decoding)


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
