"""``kvik bench``: the workload, the JSON each benchmark writes, the output-length check, the serve
client against a stand-in OpenAI server and against ``kvik serve``, bench/run_cpu.py's report, and
bench/run_gpu.py (its records, table and rooflines on made-up results, and a whole run on the CPU
with a tiny model) with the transformers peer it runs, and bench/host_step_time.py."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import kvik
from kvik.bench.common import (
    git_commit,
    non_default_engine_args,
    percentiles,
    random_workload,
    warmup_workload,
)
from kvik.bench.roofline import ModelCost, parameter_count, workload_roofline
from kvik.bench.throughput import check_output_lens
from kvik.cli.main import main

ROOT = Path(__file__).resolve().parents[3]
#: The fields every benchmark record has (kvik's and its peers'), with their types.
RECORD_FIELDS = {
    "system": str,
    "model": str,
    "num_prompts": int,
    "input_len": int,
    "output_len": int,
    "elapsed_s": float,
    "output_tok_s": float,
    "total_tok_s": float,
    "device": str,
    "date": str,
    "commit": (str, type(None)),
    "engine_args": dict,
}
THROUGHPUT_FIELDS = {**RECORD_FIELDS, "kvik_version": str, "engine_config": dict}


def assert_record(result: dict, fields: dict = RECORD_FIELDS, fresh: bool = True) -> None:
    missing = fields.keys() - result.keys()
    assert not missing, f"missing {sorted(missing)}"
    for name, kind in fields.items():
        assert isinstance(result[name], kind), f"{name}: {result[name]!r} is not {kind}"
    assert result["device"] and result["output_tok_s"] > 0 and result["total_tok_s"] > 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", result["date"])
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(
        result["date"].replace("Z", "+00:00")
    )
    assert not fresh or datetime.timedelta(0) <= age < datetime.timedelta(hours=1)
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", result["commit"])
    json.dumps(result["engine_args"])


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
    assert_record(result, THROUGHPUT_FIELDS)
    assert result["system"] == "kvik" and result["kvik_version"] == kvik.__version__
    assert (result["num_prompts"], result["input_len"], result["output_len"]) == (4, 12, 6)
    assert result["num_output_tokens"] == 4 * 6
    # The CPU's model name, as on a GPU torch.cuda.get_device_name() ("NVIDIA H200").
    assert result["platform"] == "cpu" and not result["device"].startswith("cpu")
    assert result["threads"] >= 1
    # --enforce-eager is an engine option that is not the default; the model, weights, dtype and
    # seed are what is measured, recorded in fields of their own.
    assert result["engine_args"] == {"enforce_eager": True}
    assert result["engine_config"]["cudagraph_mode"] == "none"
    assert result["engine_config"]["max_num_batched_tokens"] == 8192  # the CPU's default
    assert (result["load_format"], result["dtype"], result["seed"]) == ("dummy", "float32", 0)
    assert result["commit"] == git_commit(ROOT)  # the repository's HEAD (a checkout here)
    elapsed = result["elapsed_s"]
    assert result["output_tok_s"] == pytest.approx(24 / elapsed, rel=0.01)
    assert result["total_tok_s"] == pytest.approx((24 + 48) / elapsed, rel=0.01)
    # The timed run's scheduler counts (the warm-up's left out): one prompt step and five more
    # decode steps at least, with all four requests in one batch; nothing preempted.
    counts = result["scheduler"]
    assert 6 <= counts["num_steps"] <= 4 * 6
    assert (counts["num_preemptions"], counts["num_prefill_chunks"]) == (0, 0)
    assert counts["kv_cache_blocks"] >= 4 * 18 / counts["block_size"]


@pytest.mark.parametrize("benchmark", ["throughput", "latency"])
def test_bench_refuses_requests_longer_than_the_context(tiny_config, benchmark, capsys) -> None:
    """Prompt plus output past max_model_len is refused before the run (the engine cut each
    output short, and the run failed at its end: 'request 0 produced 2 tokens, expected 6')."""
    argv = ["bench", benchmark, *engine_options(tiny_config), "--max-model-len", "32"]
    argv += ["--input-len", "30", "--output-len", "6"]
    assert main(argv) == 2
    assert "30 prompt and 6 output tokens needs 36 tokens, more than max_model_len=32" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("warmup", [["--num-warmup-prompts", "-2"], ["--warmup-output-len", "0"]])
def test_bench_throughput_refuses_a_bad_warmup(tiny_config, warmup, capsys) -> None:
    """A negative warm-up count ran no warm-up and was recorded as -2 in the results; a
    warm-up output length of 0 was refused as 'num_prompts, input_len and output_len'."""
    argv = ["bench", "throughput", *engine_options(tiny_config), *warmup]
    assert main(argv) == 2
    assert "--num-warmup-prompts must be >= 0 and --warmup-output-len >= 1" in (
        capsys.readouterr().err
    )


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


def test_bench_serve_refuses_bad_options_and_a_missing_server(capsys) -> None:
    """A clear line and status 2, not a traceback: no server at --base-url (port 1 is never
    served), a rate or a concurrency that cannot be."""
    base = ["bench", "serve", "--vocab-size", "300", "--num-prompts", "2"]
    cases = [
        (["--base-url", "http://127.0.0.1:1"], "cannot reach http://127.0.0.1:1"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    ]
    for flags, message in cases:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err


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


def test_non_default_engine_args_and_commit(monkeypatch, tmp_path) -> None:
    from kvik.cli.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    # What is measured (model, weights, dtype, seed, device) is not an engine argument.
    headline = ["--model", "m", "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "3"]
    assert non_default_engine_args(parser.parse_args([*headline, "--device", "cuda"])) == {}
    comparison = parser.parse_args(
        [*headline, "--enforce-eager", "--no-async-scheduling", "--max-num-seqs", "128"]
    )
    assert non_default_engine_args(comparison) == {
        "async_scheduling": False,
        "enforce_eager": True,
        "max_num_seqs": 128,
    }
    monkeypatch.delenv("KVIK_BENCH_COMMIT", raising=False)
    assert git_commit(tmp_path) is None  # no checkout there
    monkeypatch.setenv("KVIK_BENCH_COMMIT", "a" * 40)
    assert git_commit(tmp_path) == "a" * 40


def load_run_gpu():
    spec = importlib.util.spec_from_file_location("run_gpu", ROOT / "bench" / "run_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_llama_config_loads_as_dummy_weights_and_rooflines() -> None:
    from kvik.model_loader.loader import load_model_config

    run_gpu = load_run_gpu()
    config = load_model_config(str(run_gpu.DEFAULT_MODEL), dtype="bfloat16", load_format="dummy")
    assert config.architecture == "LlamaForCausalLM" and config.vocab_size == 128256
    hf_config = config.hf_config
    shape = (hf_config.num_hidden_layers, hf_config.num_key_value_heads, hf_config.head_dim)
    assert shape == (32, 8, 128)
    hf = json.loads((run_gpu.DEFAULT_MODEL / "config.json").read_text())
    assert parameter_count(hf) == 8_030_261_248  # Llama-3.1-8B's
    a, b = run_gpu.WORKLOADS["A"], run_gpu.WORKLOADS["B"]
    assert (a.num_prompts, a.input_len, a.output_len) == (1, 128, 256) and a.peer_static_cache
    assert (b.num_prompts, b.input_len, b.output_len) == (256, 128, 1024)
    assert not b.peer_static_cache
    # By hand: 16.06 GB of weights a step at 4.3 TB/s is 268 tok/s at batch 1, less the KV reads
    # and the prefill; 26,000-29,000 at 256 x (128, 1024).
    cost = ModelCost.from_config(hf)
    limit_a = workload_roofline(cost, run_gpu.H200, 1, 128, 256).limit_output_tok_s
    assert 265 < limit_a < 268
    limit_b = workload_roofline(cost, run_gpu.H200, 256, 128, 1024).limit_output_tok_s
    assert 26_000 < limit_b < 29_000


def fake_record(run_gpu, key: str, system: str, out: float, **extra) -> dict:
    workload = run_gpu.WORKLOADS[key]
    hf = json.loads((run_gpu.DEFAULT_MODEL / "config.json").read_text())
    raw = {"system": system, "model": "bench/models/llama-3.1-8b", "num_prompts": workload.num_prompts,
           "input_len": workload.input_len, "output_len": workload.output_len, "elapsed_s": 1.0,
           "output_tok_s": out, "total_tok_s": 2 * out, "device": "NVIDIA H200",
           "date": "2026-11-30T10:20:00Z", "commit": None, "dtype": "bfloat16", **extra}  # fmt: skip
    return run_gpu.finish_record(
        raw, workload, system, ["python", "x"], 10.0, "2026-11-30T10:12:03Z", "c" * 40, hf
    )


def test_run_gpu_records_table_and_collect(tmp_path, capsys) -> None:
    run_gpu = load_run_gpu()
    records = [
        fake_record(run_gpu, "A", "kvik", 200.0, engine_args={}, torch_version="2.11.0+cu130"),
        fake_record(run_gpu, "A", "transformers-static-cache", 100.0,
                    engine_args={"cache_implementation": "static"}, transformers_version="5.17.0"),
        fake_record(run_gpu, "B", "kvik", 20_000.0, engine_args={}),
        fake_record(run_gpu, "B", "transformers", 2_500.0),
    ]  # fmt: skip
    kvik_a = records[0]
    assert_record(kvik_a, fresh=False)
    assert kvik_a["commit"] == "c" * 40  # the run's commit where the system had none
    assert (kvik_a["workload"], kvik_a["workload_name"]) == ("A", "gpu-latency")
    assert kvik_a["limit_output_tok_s"] == pytest.approx(267, abs=1)
    name = run_gpu.record_filename(kvik_a)
    assert name == "2026-11-30T1012Z_A-gpu-latency_kvik.json"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", run_gpu.record_filename(records[1]))
    text = run_gpu.report(records, "python bench/run_gpu.py")
    assert "NVIDIA H200" in text and "torch 2.11.0+cu130" in text
    assert "transformers 5.17.0" in text and "kvik engine arguments: defaults" in text
    rows = [line for line in text.splitlines() if line.startswith("| A") or line.startswith("| B")]
    assert len(rows) == 2
    assert rows[0].startswith(
        "| A: batch 1, 128 in, 256 out | kvik | 200.0 | 400.0 | 100.0 (static cache) | 2.00x | 267 | 74."
    )
    assert rows[1].startswith("| B: 256 prompts, 128 in, 1024 out | kvik | 20,000.0 | ")
    assert "| 2,500.0 | 8.00x | 27," in rows[1]
    # Without a peer, and on another device (the roofline is the H200's), cells stay empty.
    alone = dict(kvik_a, device="NVIDIA H100 80GB HBM3")
    assert "| kvik | 200.0 | 400.0 | - | - | - | - |" in run_gpu.table([alone])
    # --collect files a device call's $OUT (skipping failed runs and other files) and prints the table.
    out = tmp_path / "out"
    for record in [*records, dict(records[3], system="kvik-x", error="exit 1: boom")]:
        run_gpu.write_record(out / run_gpu.record_filename(record), record)
    (out / "bench_decode_attention.txt").write_text("not a record")
    results = tmp_path / "results"
    assert run_gpu.main(["--collect", str(out), "--results-dir", str(results)]) == 0
    assert sorted(p.name for p in results.iterdir()) == sorted(
        run_gpu.record_filename(r) for r in records
    )
    assert "| 8.00x |" in capsys.readouterr().out


def test_run_gpu_options(capsys) -> None:
    run_gpu = load_run_gpu()
    args, extra = run_gpu.parse_args(
        ["--workloads", "a", "--max-num-seqs", "128", "--enforce-eager", "--skip-peers"]
    )
    assert args.workloads == ["A"] and args.skip_peers
    assert extra == ["--max-num-seqs", "128", "--enforce-eager"]
    assert run_gpu.kvik_label(extra) == "kvik-max-num-seqs-128-enforce-eager"
    assert run_gpu.kvik_label([]) == "kvik"
    assert run_gpu.check_kvik_args(["--no-async-scheduling", "--cudagraph-mode", "none"]) is None
    assert "--bogus" in run_gpu.check_kvik_args(["--bogus"])
    assert "load_format" in run_gpu.check_kvik_args(["--load-format", "safetensors"])
    for bad in (["--workloads", "E"], ["--enforce-eagr"]):
        with pytest.raises(SystemExit):
            run_gpu.parse_args(bad)
    capsys.readouterr()
    assert run_gpu.main(["--dry-run", "--no-async-scheduling", "--results-dir", ""]) == 0
    printed = capsys.readouterr().out
    # A, B and C for kvik; transformers for A (static cache) and B, not C.
    assert printed.count("kvik bench throughput") == 3 and "--static-cache" in printed
    assert printed.count("hf_generate_bench.py") == 2
    assert "--no-async-scheduling" in printed and "kvik-no-async-scheduling" in printed


def test_hf_peer_draws_kvik_prompts_and_writes_the_record_fields(tiny_config) -> None:
    pytest.importorskip("transformers")
    script = ROOT / "bench" / "peers" / "hf_generate_bench.py"
    argv = [sys.executable, str(script), str(tiny_config / "config.json"), "--dtype", "float32"]
    argv += ["--num-prompts", "3", "--input-len", "10", "--output-len", "5", "--seed", "7"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert_record(result)
    assert result["system"] == "transformers" and result["random_weights"]
    assert (result["num_prompts"], result["input_len"], result["output_len"]) == (3, 10, 5)
    assert result["num_output_tokens"] == 15 and result["engine_args"] == {}
    # Without a workload file the peer draws the prompts kvik bench throughput draws.
    spec = importlib.util.spec_from_file_location("hf_peer", script)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    args = argparse.Namespace(num_prompts=3, input_len=10, output_len=5, seed=7)
    drawn = peer.random_workload(args, 256)
    assert drawn["prompts"] == random_workload(3, 10, 5, 256, seed=7).prompts
    assert drawn["warmup"]["prompts"] == warmup_workload(2, 10, 256, seed=7).prompts


def test_run_gpu_on_the_cpu(tiny_config, tmp_path, monkeypatch) -> None:
    """The whole harness, shrunk: kvik and transformers each in a process of their own, records
    in --out and --results-dir, the table printed."""
    run_gpu = load_run_gpu()
    monkeypatch.setattr(
        run_gpu,
        "WORKLOADS",
        {"B": run_gpu.GpuWorkload("B", "gpu-decode-throughput", 3, 12, 5, 2, 3, False)},
    )
    out, results = tmp_path / "out", tmp_path / "results"
    argv = [
        "--model",
        str(tiny_config),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--workloads",
        "B",
    ]
    assert run_gpu.main([*argv, "--out", str(out), "--results-dir", str(results)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in results.iterdir()) and len(files) == 2
    records = {r["system"]: r for r in (json.loads((out / f).read_text()) for f in files)}
    assert set(records) == {"kvik", "transformers"}
    for record in records.values():
        assert_record(record)
        assert (record["num_prompts"], record["input_len"], record["output_len"]) == (3, 12, 5)
        assert record["workload"] == "B" and record["commit"] == git_commit(ROOT)
    assert records["kvik"]["engine_args"] == {}  # a headline row: the engine's defaults
    assert records["kvik"]["device"] == records["transformers"]["device"]


def test_roofline_counts_fp8_weights_and_kv_cache_at_a_byte() -> None:
    from kvik.bench.roofline import ModelCost, projection_parameter_count

    config = json.loads((ROOT / "bench/models/llama-3.1-8b/config.json").read_text())
    fp8 = dict(config, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    plain, quantized = ModelCost.from_config(config), ModelCost.from_config(fp8)
    # Llama-3.1-8B: 6.98 G projection weights go from 2 bytes to 1; embeddings and LM head stay.
    assert projection_parameter_count(config) == pytest.approx(6.98e9, rel=0.01)
    assert plain.weight_bytes - quantized.weight_bytes == projection_parameter_count(config)
    assert quantized.flop_per_token == plain.flop_per_token
    assert ModelCost.from_config(config, kv_dtype_bytes=1).kv_bytes_per_token * 2 == (
        plain.kv_bytes_per_token
    )


def test_host_step_time_reports_each_part_of_the_hosts_step() -> None:
    """bench/host_step_time.py on its tiny Llama, shrunk: a median for each timed part, and the
    parts (each called once a step) inside the whole step's."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench/host_step_time.py"), "--batch-size", "8", "--output-len", "12"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    medians = dict(re.findall(r"^(\S.*?)\s+median\s+([0-9.]+) ms a step$", result.stdout, re.M))
    parts = ["schedule", "prepare_inputs", "update_from_output", "process_outputs"]
    assert sorted(medians) == sorted([*parts, "engine step (all of it)"]), result.stdout
    assert all(float(medians[p]) > 0 for p in parts)
    step = float(medians["engine step (all of it)"])
    assert sum(float(medians[p]) for p in parts[:3]) < step
