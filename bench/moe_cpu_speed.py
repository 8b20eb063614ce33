"""CPU decode speed of a small random mixture of experts: kvik against transformers' generate(),
in one process, on the same weights and prompts (issue 16's CPU goal: >= 3x at batch 8, bf16).

    python bench/moe_cpu_speed.py [--batch 8] [--output-len 64] [--threads N] [--rounds R]
        [--json FILE]

The model is a Qwen3-MoE of 16 experts with 4 routed per token over hidden size 512 (4 layers,
8 query / 4 KV heads of 64, expert intermediate size 512, vocabulary 8192), random weights saved
by transformers in bf16 into a temporary folder. Both systems get the same random prompts of
--input-len tokens, greedy, EOS ignored, and are each warmed up once with the timed batch before
the timed run; the figure is output tokens per second over the whole generate call (the prompts'
prefill is the same work for both). With --rounds R the two systems' timed runs alternate R times
and each system's fastest counts, so that a machine shared with other work (whose load comes and
goes) slows both alike; every round's times are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def build_model(folder: Path, seed: int) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
        initializer_range=0.05, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def transformers_runner(folder: Path, prompts: torch.Tensor, output_len: int):
    """A warmed-up transformers generate() of the batch: call it to time one run."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # exactly output_len tokens, as ignore_eos

    def run() -> None:
        with torch.no_grad():
            model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
            )

    run()  # warm-up
    return run


def kvik_runner(folder: Path, prompts: torch.Tensor, output_len: int):
    """A warmed-up kvik LLM.generate() of the batch: call it to time one run."""
    from kvik import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts.tolist()]

    def run() -> None:
        outputs = llm.generate(batch, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)

    run()  # warm-up
    return run


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="alternating timed runs of each")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, 8192, (args.batch, args.input_len), generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, args.seed)
        hf_run = transformers_runner(folder, prompts, args.output_len)
        kvik_run = kvik_runner(folder, prompts, args.output_len)
        rounds = [(timed(hf_run), timed(kvik_run)) for _ in range(args.rounds)]
    hf_s, kvik_s = min(r[0] for r in rounds), min(r[1] for r in rounds)
    tokens = args.batch * args.output_len
    result = {
        "workload": "cpu-moe-decode",
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": args.threads,
        "rounds_s": [{"transformers": hf, "kvik": kv} for hf, kv in rounds],
        "transformers_output_tok_s": tokens / hf_s,
        "kvik_output_tok_s": tokens / kvik_s,
        "speedup": hf_s / kvik_s,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
