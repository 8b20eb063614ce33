"""Speculative decoding's acceptance figures where users read them: the server's /metrics
(``kvik:spec_decode_*``, vLLM's names), ``kvik bench serve`` reading them over its run, and
``kvik bench throughput``/``latency`` reading the engine's counts. A draft model equal to the target
is accepted 100% (greedy), so every count is known exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client import generate_latest

from kvik.bench.server_metrics import parse_spec_decoding
from kvik.cli.main import main
from kvik.engine.async_llm import IterationStats
from kvik.scheduler.output import SchedulerStats
from kvik.spec_decode.metrics import SpecDecodingStats

K = 3


def draft_equal_to_target(folder) -> str:
    return json.dumps({"method": "draft_model", "model": str(folder), "num_speculative_tokens": K})


def test_metric_logger_counts_what_grew():
    from kvik_server.metrics import PrometheusStatLogger

    logger = PrometheusStatLogger("m")
    plain = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
    logger.record(plain, IterationStats())
    assert b"spec_decode" not in generate_latest(logger.registry)  # no speculation: no counters
    first = SpecDecodingStats(3, 2, 6, 4, [2, 1, 1])
    logger.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 1, first), IterationStats())
    second = SpecDecodingStats(3, 5, 14, 9, [5, 3, 1])
    logger.record(SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 2, second), IterationStats())
    text = generate_latest(logger.registry).decode()
    assert 'kvik:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'kvik:spec_decode_num_draft_tokens_total{model_name="m"} 14.0' in text
    assert 'kvik:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    per_pos = 'kvik:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"}'
    assert f"{per_pos % 0} 5.0" in text and f"{per_pos % 1} 3.0" in text
    assert f"{per_pos % 2} 1.0" in text  # a position that did not grow is still exposed
    # What kvik bench serve reads back from the exposition.
    assert parse_spec_decoding(text) == second


def test_server_metrics_and_bench_serve_report_acceptance(tiny_model, tmp_path):
    pytest.importorskip("kvik_server")
    from server_process import ServerProcess
    from tiny_models import save_tiny_tokenizer

    folder = tiny_model("llama")
    save_tiny_tokenizer(folder)
    server = ServerProcess(
        folder, "--dtype", "float32", "--speculative-config", draft_equal_to_target(folder)
    ).wait_ready()
    try:
        out = tmp_path / "serve.json"
        argv = ["bench", "serve", "--base-url", server.url, "--model", str(folder)]
        argv += ["--num-prompts", "4", "--input-len", "10", "--output-len", "8"]
        argv += ["--max-concurrency", "2", "--output-json", str(out)]
        run = subprocess.run(
            [sys.executable, "-m", "kvik", *argv], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr + server.output()
        assert "speculative decoding: mean accepted length" in run.stderr
        report = json.loads(out.read_text())
        assert (report["completed"], report["failed"]) == (4, 0)
        metrics = server.metrics()
    finally:
        server.stop_and_check()
    # 8 tokens a request: 1 from the prompt's step, a verification of 3 drafts and the token after
    # them (5), then of the 2 drafts that max_tokens leaves room for, and the token after (8).
    spec = report["spec_decoding"]
    assert spec["num_drafts"] == 4 * 2 and spec["num_draft_tokens"] == 4 * (3 + 2)
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
    assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_length"] == 1 + 5 / 2
    assert spec["num_accepted_tokens_per_pos"] == [8, 8, 4]
    assert metrics["kvik:spec_decode_num_drafts_total"] == 8
    assert metrics["kvik:spec_decode_num_accepted_tokens_total"] == 20
    assert metrics["kvik:generation_tokens_total"] == 4 * 8


@pytest.mark.parametrize("benchmark", ["throughput", "latency"])
def test_bench_reports_acceptance(benchmark, tiny_model, tmp_path, capsys):
    folder = tiny_model("llama")
    out = tmp_path / "result.json"
    argv = ["bench", benchmark, "--model", str(folder), "--dtype", "float32", "--enforce-eager"]
    argv += ["--speculative-config", draft_equal_to_target(folder), "--input-len", "8"]
    argv += ["--output-len", "8", "--output-json", str(out)]
    if benchmark == "throughput":
        argv += ["--num-prompts", "3", "--num-warmup-prompts", "1"]
        num_requests = 3
    else:
        argv += ["--batch-size", "1", "--num-iters-warmup", "1", "--num-iters", "2"]
        num_requests = 2
    assert main(argv) == 0
    spec = json.loads(out.read_text())["spec_decoding"]
    # The timed requests only (warm-ups are left out): two verifications each, as above.
    assert spec["num_drafts"] == 2 * num_requests
    assert spec["acceptance_rate"] == 1.0 and spec["mean_accepted_length"] == 3.5
    assert spec["acceptance_rate_per_pos"] == [1.0, 1.0, 0.5]
    assert "speculative decoding: mean accepted length 3.500" in capsys.readouterr().err
