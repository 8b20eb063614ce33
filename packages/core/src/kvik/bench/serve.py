"""``kvik bench serve``: a client that loads any OpenAI-style server with random-token requests.

Requests go to ``/v1/completions`` with the prompt as token ids, streamed, greedy, end-of-sequence
ignored. They arrive as a Poisson process at ``--request-rate`` (or all at once, ``inf``), at most
``--max-concurrency`` in flight. Per request: time to first token (TTFT), time per output token
after the first (TPOT), the gaps between streamed chunks (ITL) and end-to-end latency (E2EL).

Beside them: the roofline of the work done (kvik.bench.roofline, on the device the server names at
``/version``), and where the server has kvik's ``/metrics`` histograms, the server's own median, p99
and mean of each over the same requests (scraped before and after the run), with the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from kvik.bench.common import (
    add_workload_arguments,
    base_result,
    cpu_model,
    git_commit,
    mean,
    percentiles,
    random_workload,
    utc_now,
    write_json,
)
from kvik.bench.roofline import (
    DeviceLimits,
    ModelCost,
    device_limits,
    measure_cpu,
    roofline_fields,
)
from kvik.bench.server_metrics import comparison, scrape, server_figures, spec_decoding_between

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument(
        "--model", default=None, help="the model name to send (default: the server's first)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids are drawn below it (default: from --model's config, when kvik can read it)",
    )
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    parser.add_argument(
        "--roofline-device",
        default="auto",
        help="the device whose limits the roofline line uses: 'auto' (the one a kvik server names "
        "at /version; a CPU is probed here when it is this machine's), a name from "
        "kvik.bench.roofline's table ('H200'), or 'none'",
    )
    add_workload_arguments(parser, num_prompts=100)


def run(args: argparse.Namespace) -> int:
    try:
        from kvik.bench.http_client import ConnectionFailed
    except ImportError:
        print("kvik bench serve needs aiohttp: pip install 'kvik[bench]'", file=sys.stderr)
        return 2

    try:
        if not args.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        result = asyncio.run(benchmark(args))
    except ConnectionFailed as e:
        # No server at --base-url (or it went away): say where it was looked for.
        print(f"kvik bench serve: cannot reach {args.base_url}: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"kvik bench serve: {e}", file=sys.stderr)
        return 2
    write_json(result, args.output_json)
    return 0 if result["failed"] == 0 else 1


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from kvik.bench.http_client import BenchClient

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with BenchClient(args.base_url, headers, connect_timeout_s=30.0) as client:
        model = args.model or await first_model(client)
        config = None if args.vocab_size else model_config_of(model)
        vocab = args.vocab_size or config.vocab_size
        server = await server_info(client)
        device = roofline_device(args.roofline_device, server)  # a CPU probe runs before the clock
        workload = random_workload(
            args.num_prompts, args.input_len, args.output_len, vocab, args.seed, args.range_ratio
        )
        semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
        rng = random.Random(args.seed)
        bar = tqdm(total=args.num_prompts, desc="requests", unit="req")

        async def one(prompt: list[int], output_len: int) -> RequestResult:
            async with semaphore:
                result = await send(
                    client, args.endpoint, model, prompt, output_len, not args.no_ignore_eos
                )
            bar.update(1)
            return result

        metrics_before = await scrape(client)
        start = time.perf_counter()
        tasks = []
        for prompt, output_len in zip(workload.prompts, workload.output_lens):
            tasks.append(asyncio.create_task(one(prompt, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        metrics_after = await scrape(client)
    for r, want in zip(results, workload.output_lens):
        if r.ok and not args.no_ignore_eos and r.output_tokens != want:
            r.ok, r.error = False, f"produced {r.output_tokens} tokens, expected {want}"
    result = summarize(args, model, results, duration)
    result["server"] = server
    fields, line = serve_roofline(args, config, server, device, results, duration)
    result.update(fields)
    print(line, file=sys.stderr)
    # The server's own histograms over the same requests, beside the client's figures.
    result["server_metrics"] = server_figures(
        metrics_before and metrics_before.histograms, metrics_after and metrics_after.histograms
    )
    if result["server_metrics"]:
        print(comparison(result, result["server_metrics"]), file=sys.stderr)
    spec = spec_decoding_between(metrics_before, metrics_after)
    if spec is not None:
        result["spec_decoding"] = spec.to_json()
        print(f"kvik bench serve: speculative decoding: {spec.summary()}", file=sys.stderr)
    return result


async def first_model(client: Any) -> str:
    response = await client.get("/v1/models")
    if response.status_code != 200:
        raise ValueError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]["id"]


def model_config_of(model: str) -> Any:
    """The served model's config (kvik.config.ModelConfig), read where this client runs."""
    from kvik.model_loader.loader import load_model_config

    try:  # only the config is read: a folder of dummy-weight shapes (no weights) will do
        return load_model_config(model, load_format="dummy")
    except Exception as e:
        raise ValueError(f"cannot read {model!r}'s vocabulary size ({e}): pass --vocab-size") from e


async def server_info(client: Any) -> dict[str, Any]:
    """What the server says of itself at /version (a kvik server: version, platform, device,
    dtype); empty where it says nothing."""
    try:
        response = await client.get("/version")
        info = response.json() if response.status_code == 200 else {}
    except Exception:  # another server, or none at that route: no roofline, the run goes on
        return {}
    return info if isinstance(info, dict) else {}


def roofline_device(choice: str, server: dict[str, Any]) -> DeviceLimits | None:
    """The limits of --roofline-device: none, a table entry by name, or the server's own device
    (a CPU is measured here, only when it is this machine's CPU)."""
    if choice == "none":
        return None
    if choice != "auto":
        limits = device_limits(choice)
        if limits is None:
            raise ValueError(f"--roofline-device {choice!r} is not in kvik.bench.roofline's table")
        return limits
    name = server.get("device")
    if server.get("platform") == "cpu":
        if name != cpu_model():
            return None  # another machine's CPU: this one's figures would say nothing of it
        import torch

        return measure_cpu(name, getattr(torch, server.get("dtype") or "float32", None))
    return device_limits(name)


def serve_roofline(
    args: argparse.Namespace,
    config: Any,
    server: dict[str, Any],
    device: DeviceLimits | None,
    results: list[RequestResult],
    duration: float,
) -> tuple[dict[str, Any], str]:
    """The roofline of the requests that completed, run as many at a time as were in flight on
    average (their summed latency over the run's time, by Little's law)."""
    done = [r for r in results if r.ok]
    if not done:
        return {"roofline": None}, "roofline: none (no request completed)"
    if device is None:
        where = server.get("device") or "the server's device (not named at /version)"
        return {"roofline": None}, f"roofline: none (no figures for {where})"
    if config is None:
        return {"roofline": None}, "roofline: none (--vocab-size given: the model is not read)"
    in_flight = max(1, round(sum(r.e2el for r in done) / duration))
    dtype_bytes = {"float32": 4}.get(server.get("dtype"), 2)
    try:
        cost = ModelCost.from_config(config.hf_config, dtype_bytes)
    except (KeyError, TypeError, AttributeError):
        cost = None
    input_len = round(sum(r.prompt_len for r in done) / len(done))
    output_len = round(sum(r.output_tokens for r in done) / len(done))
    fields, line = roofline_fields(
        cost, device, len(done), input_len, max(1, output_len), duration, in_flight
    )
    return fields, line + (
        f"; {in_flight} requests in flight on average"
        + (" (an arrival rate below the device's keeps a run under its limit)"
        if args.request_rate != float("inf") else "")
    )  # fmt: skip


async def send(
    client: Any, endpoint: str, model: str, prompt: list[int], max_tokens: int, ignore_eos: bool
) -> RequestResult:
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        # Closed on every way out (the early returns too), so its connection is freed at once.
        async with aclosing(client.stream_lines(endpoint, payload)) as stream:
            async for status, line in stream:
                if status != 200:
                    result.error = f"HTTP {status}: {line[:200]}"
                    return result
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                message = json.loads(data)
                if message.get("usage"):
                    usage_tokens = message["usage"].get("completion_tokens")
                if not message.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except Exception as e:  # a failed request is counted, the run goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2el = last - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


def summarize(
    args: argparse.Namespace, model: str, results: list[RequestResult], duration: float
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    num_output = sum(r.output_tokens for r in done)
    num_input = sum(r.prompt_len for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }
    result = {
        **base_result("kvik-bench-serve", model),
        "date": utc_now(),
        "commit": git_commit(),
        "base_url": args.base_url,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "elapsed_s": round(duration, 4),
        "request_s": round(len(done) / duration, 3),
        "output_tok_s": round(num_output / duration, 2),
        "total_tok_s": round((num_output + num_input) / duration, 2),
    }
    for name in METRICS:
        values_ms = [v * 1000 for v in samples[name]]
        result[f"mean_{name}_ms"] = round(mean(values_ms), 3)
        result[f"median_{name}_ms"] = round(percentiles(values_ms, (50,))["p50"], 3)
        result[f"p99_{name}_ms"] = round(percentiles(values_ms, (99,))["p99"], 3)
    print(report(result), file=sys.stderr)
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"completed {result['completed']}, failed {result['failed']} in {result['elapsed_s']:.2f} s",
        f"requests/s {result['request_s']:.2f}, output tok/s {result['output_tok_s']:.1f}, "
        f"total tok/s {result['total_tok_s']:.1f}",
    ]
    for name in METRICS:
        lines.append(
            f"{name.upper():5} ms: mean {result[f'mean_{name}_ms']:.2f}, "
            f"median {result[f'median_{name}_ms']:.2f}, p99 {result[f'p99_{name}_ms']:.2f}"
        )
    return "\n".join(lines)
