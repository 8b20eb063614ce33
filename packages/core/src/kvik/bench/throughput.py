"""``kvik bench throughput``: offline tokens/s of one batch of random prompts, as vLLM's.

The timed prompts are all added at once and the clock runs until the last one finishes. The
warm-up prompts come from another seed, so no block of theirs can be a cached prefix of a timed one.
The JSON (``--output-json``) holds the figures and what they were measured on: ``device`` as torch
names it, ``date`` (UTC), ``commit``, and ``engine_args``, the engine options that were not the
defaults (empty for a headline figure).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvik.bench.common import (
    Workload,
    add_workload_arguments,
    base_result,
    check_fits,
    random_workload,
    report_spec_decoding,
    run_metadata,
    scheduler_counts,
    spec_decoding_counts,
    warmup_workload,
    write_json,
)
from kvik.bench.roofline import engine_device_limits, engine_model_cost, roofline_fields
from kvik.cli.engine_args import add_engine_arguments, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--num-warmup-prompts", type=int, default=2, help="prompts generated before timing"
    )
    parser.add_argument(
        "--warmup-output-len",
        type=int,
        default=4,
        help="tokens each warm-up prompt generates (default 4; the timed --output-len warms up "
        "decode steps at every context length the timed run reaches)",
    )
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvik import LLM

    try:
        if args.num_warmup_prompts < 0 or args.warmup_output_len < 1:
            raise ValueError(
                "--num-warmup-prompts must be >= 0 and --warmup-output-len >= 1, got "
                f"{args.num_warmup_prompts} and {args.warmup_output_len}"
            )
        llm = LLM(**engine_kwargs(args))
        vocab = llm.config.model.vocab_size
        workload = random_workload(
            args.num_prompts, args.input_len, args.output_len, vocab, args.seed, args.range_ratio
        )
        check_fits(workload, llm.config.model.max_model_len)
        if args.num_warmup_prompts > 0:
            warmup = warmup_workload(
                args.num_warmup_prompts, args.input_len, vocab, args.seed, args.warmup_output_len
            )
            check_fits(warmup, llm.config.model.max_model_len)
            generate(llm, warmup, ignore_eos=True, use_tqdm=False)
        device = engine_device_limits(llm)  # the CPU's probe runs here, before the clock
        spec_before = spec_decoding_counts(llm)
        stats_before = llm.stats
        start = time.perf_counter()
        produced = generate(llm, workload, ignore_eos=not args.no_ignore_eos, use_tqdm=True)
        elapsed = time.perf_counter() - start
    except ValueError as e:
        print(f"kvik bench throughput: {e}", file=sys.stderr)
        return 2
    short = check_output_lens(workload, produced, strict=not args.no_ignore_eos)
    if short:
        print(f"kvik bench throughput: {short}", file=sys.stderr)
        return 1
    result = throughput_result(llm, args, workload, produced, elapsed)
    result["scheduler"] = scheduler_counts(llm, stats_before)
    # The engine runs at most max_num_seqs requests at a time; the roofline's batches are as big.
    concurrency = llm.config.scheduler.max_num_seqs
    fields, line = roofline_fields(
        engine_model_cost(llm), device, args.num_prompts, args.input_len, args.output_len,
        elapsed, concurrency,
    )  # fmt: skip
    result.update(fields)
    report_spec_decoding(llm, spec_before, result, "kvik bench throughput")
    counts = result["scheduler"]
    print(
        f"throughput: {result['output_tok_s']:,.1f} output tok/s, "
        f"{result['total_tok_s']:,.1f} total tok/s; {line}; {counts['num_steps']} steps, "
        f"{counts['num_preemptions']} preemptions",
        file=sys.stderr,
    )
    write_json(result, args.output_json)
    return 0


def generate(llm: Any, workload: Workload, ignore_eos: bool, use_tqdm: bool) -> list[int]:
    """Runs the workload greedily; returns the number of tokens each request produced."""
    from kvik import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
        for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    return [len(out.outputs[0].token_ids) for out in outputs]


def check_output_lens(workload: Workload, produced: list[int], strict: bool) -> str | None:
    """An error message if a request produced more tokens than asked, or fewer where EOS is
    ignored; None if all is well."""
    for i, (want, got) in enumerate(zip(workload.output_lens, produced)):
        if got > want or (strict and got != want):
            return f"request {i} produced {got} tokens, expected {want}"
    return None


def throughput_result(
    llm: Any, args: argparse.Namespace, workload: Workload, produced: list[int], elapsed: float
) -> dict[str, Any]:
    num_output = sum(produced)
    return {
        **base_result("kvik", llm.config.model.name or str(llm.config.model.path)),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "dtype": str(llm.config.model.dtype).removeprefix("torch."),
        "elapsed_s": round(elapsed, 4),
        "num_output_tokens": num_output,
        "output_tok_s": round(num_output / elapsed, 2),
        "total_tok_s": round((num_output + workload.num_input_tokens) / elapsed, 2),
        "num_warmup_prompts": args.num_warmup_prompts,
        "warmup_output_len": args.warmup_output_len,
        **run_metadata(llm, args),
    }
