"""``kvik bench latency``: how long one batch takes from submission to its last token.

Each iteration gets prompts of its own (one seed per iteration), so prefix caching never turns a
repeated prompt into a shorter prefill.
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm.auto import tqdm

from kvik.bench.common import (
    base_result,
    check_fits,
    mean,
    percentiles,
    random_workload,
    report_spec_decoding,
    run_metadata,
    spec_decoding_counts,
    write_json,
)
from kvik.bench.roofline import engine_device_limits, engine_model_cost, roofline_fields
from kvik.bench.throughput import check_output_lens, generate
from kvik.cli.engine_args import add_engine_arguments, engine_kwargs

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvik import LLM

    if args.num_iters < 1 or args.num_iters_warmup < 0:
        print(
            "kvik bench latency: --num-iters must be >= 1, --num-iters-warmup >= 0", file=sys.stderr
        )
        return 2
    try:
        llm = LLM(**engine_kwargs(args))
        batches = [
            random_workload(
                args.batch_size,
                args.input_len,
                args.output_len,
                llm.config.model.vocab_size,
                seed=args.seed + i,
            )
            for i in range(args.num_iters_warmup + args.num_iters)
        ]
        for batch in batches:
            check_fits(batch, llm.config.model.max_model_len)
        device = engine_device_limits(llm)  # the CPU's probe runs here, before the clock
        latencies = []
        spec_before = None
        iterations = tqdm(batches, desc="iterations", unit="batch")
        for i, batch in enumerate(iterations):
            if i == args.num_iters_warmup:  # acceptance counts the timed iterations only
                spec_before = spec_decoding_counts(llm)
            start = time.perf_counter()
            produced = generate(llm, batch, ignore_eos=True, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if error := check_output_lens(batch, produced, strict=True):
                print(f"kvik bench latency: {error}", file=sys.stderr)
                return 1
            if i >= args.num_iters_warmup:
                latencies.append(elapsed)
    except ValueError as e:
        print(f"kvik bench latency: {e}", file=sys.stderr)
        return 2
    avg = mean(latencies)
    batch_tokens = args.batch_size * args.output_len
    result = {
        **base_result("kvik", llm.config.model.name or str(llm.config.model.path)),
        "batch_size": args.batch_size,
        "num_prompts": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": str(llm.config.model.dtype).removeprefix("torch."),
        "num_iters": args.num_iters,
        "latencies_s": [round(t, 6) for t in latencies],
        "avg_latency_s": round(avg, 6),
        "percentiles_s": {k: round(v, 6) for k, v in percentiles(latencies, PERCENTILES).items()},
        "elapsed_s": round(avg, 6),
        "output_tok_s": round(batch_tokens / avg, 2),
        "total_tok_s": round((batch_tokens + args.batch_size * args.input_len) / avg, 2),
        **run_metadata(llm, args),
    }
    fields, line = roofline_fields(
        engine_model_cost(llm), device, args.batch_size, args.input_len, args.output_len, avg
    )
    result.update(fields)
    report_spec_decoding(llm, spec_before, result, "kvik bench latency")
    print(
        f"latency over {args.num_iters} iterations: mean {avg:.3f} s, "
        + ", ".join(f"{k} {v:.3f} s" for k, v in result["percentiles_s"].items())
        + f"; {result['output_tok_s']:,.1f} output tok/s; {line}",
        file=sys.stderr,
    )
    write_json(result, args.output_json)
    return 0
