"""The cost of structured outputs on the CPU (issue 17): output tok/s at batch 32 with a JSON
schema against the same batch unconstrained, in one process, alternating, and the grammar
compile time of each test schema (tests/structured_output_schemas.py).

    python bench/structured_outputs_cpu.py [--model smollm2-135m-instruct] [--rounds 3]

Both arms generate exactly ``--max-tokens`` tokens a request: the unconstrained one ignores EOS,
and the schema (an array of at least 40 objects) cannot end sooner, so the batch stays full and
the token counts are equal. Each arm runs once untimed first (the grammar compiles there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvik import LLM, SamplingParams
from kvik.sampling_params import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from structured_output_schemas import SCHEMAS  # noqa: E402

LONG_SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}


def output_tokens_per_second(llm: LLM, prompts: list, params: list[SamplingParams]) -> float:
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def compile_times(llm: LLM) -> list[float]:
    """Seconds to compile each test schema with the engine's tokenizer, caching off."""
    import xgrammar as xgr

    from kvik.structured_output.grammar import compile_grammar, grammar_key, tokenizer_info

    model = llm.config.model
    info = tokenizer_info(llm.get_tokenizer(), model.vocab_size, sorted(model.eos_token_ids()))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    times = []
    for schema in SCHEMAS:
        key = grammar_key(StructuredOutputsParams(json=schema))
        start = time.perf_counter()
        compile_grammar(compiler, key)  # as the engine compiles it
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=1024, max_num_seqs=args.batch)
    prompts = [
        [{"role": "user", "content": f"List {40 + i} people with their ages as JSON."}]
        for i in range(args.batch)
    ]
    free = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.batch)
    ]
    schema = StructuredOutputsParams(json=LONG_SCHEMA)
    constrained = [
        SamplingParams(
            temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=schema
        )
        for i in range(args.batch)
    ]
    for params in (free, constrained):  # warm-up; the grammar compiles here
        output_tokens_per_second(llm, prompts, params)
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", free), ("json_schema", constrained)):
            rates[name].append(output_tokens_per_second(llm, prompts, params))
            print(f"{name}: {rates[name][-1]:.1f} output tok/s", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    times = compile_times(llm)
    result = {
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "output_tok_per_s": rates,
        "median_output_tok_per_s": medians,
        "json_schema_vs_unconstrained": medians["json_schema"] / medians["unconstrained"],
        "compile_ms_per_test_schema": [round(t * 1e3, 2) for t in times],
        "compile_ms_median": round(statistics.median(times) * 1e3, 2),
        "compile_ms_max": round(max(times) * 1e3, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
