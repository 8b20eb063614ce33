"""``kvik bench``: the workload, the JSON each benchmark writes, the output-length check, the serve
client against a stand-in OpenAI server and against ``kvik serve``, and bench/run_cpu.py's report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kvik
from kvik.bench.common import percentiles, random_workload, warmup_workload
from kvik.bench.throughput import check_output_lens
from kvik.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
THROUGHPUT_FIELDS = {
    "system",
    "model",
    "num_prompts",
    "input_len",
    "output_len",
    "elapsed_s",
    "output_tok_s",
    "total_tok_s",
    "device",
    "kvik_version",
}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """A config.json only: the engine builds the shapes with --load-format dummy."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-config")
    LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    return folder


def engine_options(folder: Path) -> list[str]:
    return [
        "--model",
        str(folder),
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--enforce-eager",
    ]


def test_random_workload_is_seeded_and_keeps_away_from_special_tokens() -> None:
    a = random_workload(8, 20, 10, vocab_size=1000, seed=3)
    assert a == random_workload(8, 20, 10, vocab_size=1000, seed=3)
    assert a != random_workload(8, 20, 10, vocab_size=1000, seed=4)
    assert all(len(p) == 20 for p in a.prompts) and a.output_lens == [10] * 8
    assert all(100 <= t < 900 for p in a.prompts for t in p)
    ranged = random_workload(200, 20, 10, vocab_size=1000, seed=3, range_ratio=0.5)
    assert {len(p) for p in ranged.prompts} <= set(range(10, 31))
    assert len({len(p) for p in ranged.prompts}) > 5
    assert set(ranged.output_lens) <= set(range(5, 16))
    warm = warmup_workload(2, 20, vocab_size=1000, seed=3)
    assert not {tuple(p[:16]) for p in warm.prompts} & {tuple(p[:16]) for p in a.prompts}
    with pytest.raises(ValueError, match="range_ratio"):
        random_workload(1, 4, 4, vocab_size=1000, range_ratio=1.0)
    with pytest.raises(ValueError, match=">= 1"):
        random_workload(0, 4, 4, vocab_size=1000)


def test_percentiles_interpolate_as_numpy() -> None:
    np = pytest.importorskip("numpy")
    values = [0.3, 1.0, 0.2, 5.0, 2.5, 0.9, 1.1]
    got = percentiles(values, (10, 50, 90, 99))
    for p in (10, 50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(np.percentile(values, p))


def test_output_length_check() -> None:
    workload = random_workload(3, 4, 8, vocab_size=1000)
    assert check_output_lens(workload, [8, 8, 8], strict=True) is None
    assert "request 1 produced 5 tokens, expected 8" in check_output_lens(
        workload, [8, 5, 8], strict=True
    )
    # With end-of-sequence honoured a request may stop early, never run over.
    assert check_output_lens(workload, [8, 5, 8], strict=False) is None
    assert check_output_lens(workload, [9, 8, 8], strict=False) is not None


def test_bench_throughput_writes_the_peer_fields(tiny_config, tmp_path) -> None:
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", *engine_options(tiny_config), "--num-prompts", "4"]
    argv += ["--input-len", "12", "--output-len", "6", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert THROUGHPUT_FIELDS <= result.keys()
    assert result["system"] == "kvik" and result["kvik_version"] == kvik.__version__
    assert (result["num_prompts"], result["input_len"], result["output_len"]) == (4, 12, 6)
    assert result["num_output_tokens"] == 4 * 6
    assert result["device"].startswith("cpu")
    elapsed = result["elapsed_s"]
    assert result["output_tok_s"] == pytest.approx(24 / elapsed, rel=0.01)
    assert result["total_tok_s"] == pytest.approx((24 + 48) / elapsed, rel=0.01)


def test_bench_latency_reports_mean_and_percentiles(tiny_config, tmp_path) -> None:
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", *engine_options(tiny_config), "--batch-size", "2"]
    argv += ["--input-len", "8", "--output-len", "4", "--num-iters-warmup", "1"]
    argv += ["--num-iters", "3", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies_s"]) == 3
    assert {"p50", "p90", "p99"} <= result["percentiles_s"].keys()
    assert result["avg_latency_s"] == pytest.approx(sum(result["latencies_s"]) / 3, abs=1e-3)
    assert result["output_tok_s"] == pytest.approx(2 * 4 / result["avg_latency_s"], rel=0.01)


class FakeCompletions(BaseHTTPRequestHandler):
    """A stand-in OpenAI server: streams one chunk per token, ``short_by`` tokens too few."""

    short_by = 0
    requests: list[dict] = []

    def do_GET(self) -> None:
        self._send_json({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"] - self.short_by
        for i in range(n):
            time.sleep(0.002)
            self._event({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, message: dict) -> None:
        self.wfile.write(f"data: {json.dumps(message)}\n\n".encode())
        self.wfile.flush()

    def _send_json(self, message: dict) -> None:
        data = json.dumps(message).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_server():
    FakeCompletions.short_by = 0
    FakeCompletions.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def serve_argv(url: str, out: Path, *extra: str) -> list[str]:
    argv = ["bench", "serve", "--base-url", url, "--num-prompts", "6", "--input-len", "10"]
    return argv + ["--output-len", "5", "--output-json", str(out), *extra]


def test_bench_serve_reports_every_metric(fake_server, tmp_path) -> None:
    out = tmp_path / "serve.json"
    argv = serve_argv(fake_server, out, "--vocab-size", "300", "--request-rate", "50")
    assert main([*argv, "--max-concurrency", "2"]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "fake-model"  # asked of /v1/models
    assert (result["completed"], result["failed"]) == (6, 0)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert result[f"{stat}_{name}_ms"] > 0
    assert result["median_e2el_ms"] >= result["median_ttft_ms"]
    assert result["output_tok_s"] == pytest.approx(30 / result["elapsed_s"], rel=0.01)
    assert result["total_tok_s"] == pytest.approx(90 / result["elapsed_s"], rel=0.01)
    assert result["request_s"] == pytest.approx(6 / result["elapsed_s"], rel=0.01)
    sent = FakeCompletions.requests
    assert len(sent) == 6 and all(r["stream"] and r["ignore_eos"] for r in sent)
    assert all(len(r["prompt"]) == 10 and max(r["prompt"]) < 300 for r in sent)
    assert all(r["temperature"] == 0.0 and r["max_tokens"] == 5 for r in sent)


def test_bench_serve_fails_requests_that_come_back_short(fake_server, tmp_path) -> None:
    FakeCompletions.short_by = 1
    out = tmp_path / "serve.json"
    assert main(serve_argv(fake_server, out, "--vocab-size", "300")) == 1
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (0, 6)
    assert "produced 4 tokens, expected 5" in result["errors"][0]


def test_bench_serve_against_kvik_serve(tmp_path) -> None:
    pytest.importorskip("kvik_server")
    from tiny_models import build_tiny_model, save_tiny_tokenizer

    model = build_tiny_model("llama", tmp_path / "model")
    save_tiny_tokenizer(model)
    from server_process import ServerProcess

    server = ServerProcess(model, "--dtype", "float32").wait_ready()
    try:
        out = tmp_path / "serve.json"
        argv = serve_argv(server.url, out, "--model", str(model), "--max-concurrency", "3")
        result = subprocess.run(
            [sys.executable, "-m", "kvik", *argv], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr + server.output()
        report = json.loads(out.read_text())
        assert (report["completed"], report["failed"]) == (6, 0)
        assert report["median_tpot_ms"] > 0 and report["median_ttft_ms"] > 0
    finally:
        server.stop_and_check()


def load_run_cpu():
    spec = importlib.util.spec_from_file_location("run_cpu", ROOT / "bench" / "run_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_cpu_summary_ratios_and_docs_section(tmp_path) -> None:
    run_cpu = load_run_cpu()

    def run(system: str, out: float) -> dict:
        return {"system": system, "num_prompts": 4, "input_len": 16, "output_len": 16,
                "output_tok_s": out, "total_tok_s": 2 * out}  # fmt: skip

    results = {
        "cpu-throughput": {
            "kvik": [run("kvik", v) for v in (100, 300, 200)],
            "vllm-cpu": [run("vllm-cpu", v) for v in (90, 110, 100)],
            "transformers": [{"error": "exit 1: boom"}],
        }
    }
    args = type("Args", (), {"argv": ["--runs", "3"], "model": "m", "threads": 2, "runs": 3})
    summary = run_cpu.summarize(args, tmp_path, results)
    workload = summary["workloads"]["cpu-throughput"]
    assert workload["systems"]["kvik"]["median_output_tok_s"] == 200
    assert workload["systems"]["transformers"]["median_output_tok_s"] is None
    assert workload["ratios"] == {"kvik/vllm-cpu": 2.0}
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nSomeone else's section.\n")
    run_cpu.update_docs(docs, summary, tmp_path / "cpu.png")
    run_cpu.update_docs(docs, summary, tmp_path / "cpu.png")  # replaced, not appended twice
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nSomeone else's section.\n")
    assert text.count(run_cpu.SECTION_START) == 1 and "kvik/vllm-cpu = 2.00x" in text
    assert "| cpu-throughput | transformers | - | - | error |" in text
    pytest.importorskip("matplotlib")
    run_cpu.plot(summary, tmp_path / "cpu.png")
    assert (tmp_path / "cpu.png").read_bytes().startswith(b"\x89PNG")
