"""n-gram speculative decoding on the CPU (issue 18): batch-1 output tok/s of the default model in
bf16 with ``method=ngram`` against the same engine without speculation, in one process, on
prompts whose answer copies their text ("Repeat the following text exactly", paragraphs of 200 to
400 tokens), greedy; and the acceptance (rate, mean accepted length, per position).

    python bench/spec_decode_cpu.py [--threads 1] [--num-speculative-tokens 5] [--rounds 2]

Each prompt runs alone (batch 1) with the chat template, greedy, up to its paragraph's length in
tokens plus 16; the two engines alternate prompt by prompt, so both see the same machine. Each
engine's tok/s counts its own output tokens. Greedy outputs should be identical; where they are
not, the script says where they part (the first differing output token). Each engine runs one
untimed request first. Writes JSON to ``--output-json`` or to $OUT/spec_decode_cpu.json where $OUT
is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from kvik import LLM, SamplingParams
from kvik.bench.common import cpu_model, git_commit, utc_now

PARAGRAPHS = [
    "The harbour town woke before the sun. Fishermen carried coils of rope down the stone steps "
    "to the water, where the boats knocked gently against the quay, and the smell of tar and salt "
    "hung over everything. At the top of the hill the baker had already lit his oven; the first "
    "loaves came out a little after five, and by six there was a queue of children sent by their "
    "mothers, each with a coin and a cloth bag. The harbour master walked the length of the pier "
    "twice every morning, once to read the sky and once to read the faces of the men, and he said "
    "that the second told him more about the weather than the first. When the wind came from the "
    "north the boats stayed in, the nets were mended on the slipway, and the old men played cards "
    "in the back room of the inn until the light went. When it came from the west, everyone "
    "went out, even the boys who were still at school, and the town was quiet until evening, when "
    "the boats returned low in the water and the gulls followed them in, screaming.",
    "A compiler turns a program written for people into instructions a machine can run. It first "
    "reads the text into tokens, then arranges the tokens into a tree that mirrors the structure "
    "of the program: functions contain statements, statements contain expressions, and "
    "expressions contain names and numbers. Most of the interesting work happens on that tree or "
    "on a simpler form derived from it. The compiler checks that every name refers to something "
    "that exists and that every operation is applied to values of a suitable type. It then looks "
    "for work that can be done once instead of many times, for values that are computed but never "
    "used, and for loops whose bodies can be rearranged so that the processor spends less time "
    "waiting for memory. Finally it chooses machine instructions, assigns the most used values to "
    "registers, and writes out a file that the operating system can load. Each of these stages "
    "can be replaced without touching the others, which is why the same compiler can read "
    "several languages and produce code for several kinds of processor. It is also why a "
    "small change to one stage, such as a better way to choose registers, can make every "
    "program built with the compiler a little faster without anyone rewriting a line of them.",
    "To plant a tree well, choose the place before you choose the tree. Watch where the sun falls "
    "in the morning and in the afternoon, notice where water collects after rain, and look up for "
    "wires and gutters that a grown crown would reach. Dig a hole twice as wide as the root ball "
    "but no deeper than it, so that the tree sits at the same height it grew in the nursery. "
    "Loosen the roots that circle the pot with your fingers; if they are thick and tangled, cut "
    "through them in three or four places with a sharp knife. Set the tree upright, fill the hole "
    "with the soil you removed, and firm it with your heel to close the air pockets. Water slowly "
    "and deeply, then spread a ring of mulch around the trunk without letting it touch the bark. "
    "For the first two summers water once a week when it does not rain, and check the ties of the "
    "stake each spring so that they never cut into the growing stem. After the third year the "
    "roots reach far enough to find water on their own, the stake can come out, and the tree "
    "needs nothing from you but a look at its leaves now and then.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="times each prompt is timed")
    parser.add_argument("--output-json", default=None)
    return parser.parse_args()


def engine(model: str | None, speculative_config: dict | None) -> LLM:
    kwargs = {"model": model} if model else {}
    return LLM(
        dtype="bfloat16",
        max_model_len=2048,
        num_kv_blocks=256,
        speculative_config=speculative_config,
        **kwargs,
    )


def timed(llm: LLM, messages: list[dict], params: SamplingParams) -> tuple[list[int], float]:
    start = time.perf_counter()
    output = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    return list(output.token_ids), time.perf_counter() - start


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output token where ``a`` and ``b`` differ (None: they are equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    plain, speculative = engine(args.model, None), engine(args.model, ngram)
    tokenizer = plain.get_tokenizer()
    conversations = [
        [{"role": "user", "content": f"Repeat the following text exactly:\n\n{paragraph}"}]
        for paragraph in PARAGRAPHS
    ]
    warm = [{"role": "user", "content": "Say hello."}]
    for llm in (plain, speculative):
        llm.chat(warm, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    before = speculative.stats.spec_decoding.copy()
    seconds = {"plain": 0.0, "ngram": 0.0}
    tokens = {"plain": 0, "ngram": 0}
    per_prompt = []
    for i, messages in enumerate(conversations):
        paragraph_tokens = len(tokenizer.encode(PARAGRAPHS[i]))
        params = SamplingParams(temperature=0.0, max_tokens=paragraph_tokens + 16)
        parted = []  # per round: the first output token where the engines' outputs differ
        outputs: dict[str, list[list[int]]] = {"plain": [], "ngram": []}
        for _ in range(args.rounds):
            expected, plain_s = timed(plain, messages, params)
            got, ngram_s = timed(speculative, messages, params)
            seconds["plain"] += plain_s
            seconds["ngram"] += ngram_s
            tokens["plain"] += len(expected)
            tokens["ngram"] += len(got)
            parted.append(first_difference(expected, got))
            outputs["plain"].append(expected)
            outputs["ngram"].append(got)
        per_prompt.append(
            {
                "paragraph_tokens": paragraph_tokens,
                "plain_output_tokens": len(expected),
                "ngram_output_tokens": len(got),
                "outputs_part_at": parted,  # per round, None: identical
                # Whether each engine repeated its own output in every round (the later rounds
                # find the prompt in the prefix cache).
                "rounds_agree": {
                    name: all(o == runs[0] for o in runs) for name, runs in outputs.items()
                },
                "plain_tok_s": round(len(expected) / plain_s, 2),
                "ngram_tok_s": round(len(got) / ngram_s, 2),
            }
        )
        print(
            f"prompt {i}: paragraph {paragraph_tokens} tokens, output {len(expected)} tokens; "
            f"plain {len(expected) / plain_s:.1f} tok/s, ngram {len(got) / ngram_s:.1f} tok/s "
            f"(last round); outputs part at (per round, None: identical) {parted}",
            file=sys.stderr,
        )
    stats = speculative.stats.spec_decoding.minus(before)
    plain_rate = tokens["plain"] / seconds["plain"]
    ngram_rate = tokens["ngram"] / seconds["ngram"]
    result = {
        "model": str(plain.config.model.path),
        "device": cpu_model(),
        "date": utc_now(),
        "commit": git_commit(),
        "dtype": "bfloat16",
        "threads": torch.get_num_threads(),
        "speculative_config": ngram,
        "rounds": args.rounds,
        "num_output_tokens": tokens,
        "plain_output_tok_s": round(plain_rate, 2),
        "ngram_output_tok_s": round(ngram_rate, 2),
        "speedup": round(ngram_rate / plain_rate, 3),
        "outputs_identical": all(p is None for q in per_prompt for p in q["outputs_part_at"]),
        "spec_decoding": stats.to_json(),
        "prompts": per_prompt,
    }
    print(
        f"batch 1, {torch.get_num_threads()} thread(s): plain {plain_rate:.1f} output tok/s, "
        f"ngram (k={args.num_speculative_tokens}) {ngram_rate:.1f} output tok/s: "
        f"{ngram_rate / plain_rate:.2f}x; {stats.summary()}",
        file=sys.stderr,
    )
    text = json.dumps(result, indent=2)
    print(text)
    path = args.output_json or (
        os.path.join(os.environ["OUT"], "spec_decode_cpu.json") if os.environ.get("OUT") else None
    )
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
