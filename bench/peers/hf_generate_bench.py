"""Hugging Face transformers ``generate()`` on a workload file of bench/run_cpu.py; one JSON line.

    python bench/peers/hf_generate_bench.py MODEL_DIR WORKLOAD.json [--dtype bfloat16]

transformers has no scheduler, so every prompt goes into one batch, as a user would call it; that
needs fixed lengths (a workload with range ratio 0). ``min_new_tokens`` makes it ignore EOS.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("workload")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()

    def run(prompts: list[list[int]], output_lens: list[int]) -> int:
        if len({len(p) for p in prompts}) != 1 or len(set(output_lens)) != 1:
            raise SystemExit("transformers' batch needs fixed lengths: use range ratio 0")
        ids = torch.tensor(prompts, device=args.device)
        n = output_lens[0]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
        if args.device != "cpu":
            torch.cuda.synchronize()
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    prompts, output_lens = workload["prompts"], workload["output_lens"]
    with torch.inference_mode():
        run(workload["warmup"]["prompts"], workload["warmup"]["output_lens"])
        start = time.perf_counter()
        num_output = run(prompts, output_lens)
        elapsed = time.perf_counter() - start
    if num_output != sum(output_lens):
        raise SystemExit(f"transformers produced {num_output} tokens, expected {sum(output_lens)}")
    num_input = sum(len(p) for p in prompts)
    print(
        json.dumps(
            {
                "system": "transformers",
                "model": args.model,
                "num_prompts": len(prompts),
                "input_len": workload["input_len"],
                "output_len": workload["output_len"],
                "elapsed_s": round(elapsed, 4),
                "output_tok_s": round(num_output / elapsed, 2),
                "total_tok_s": round((num_output + num_input) / elapsed, 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
