"""Speculative decoding's costs on the GPU (issue 18), at batch 1 on Llama-3.1-8B shapes (dummy
weights, bf16, the engine's default graphs):

1. a verification step (the newest token and k = 4 drafts scored in one forward, then the
   rejection sampler and the n-gram proposer) against a plain decode step of the same engine
   (goal: at most 1.25x);
2. an EAGLE-3 head of the 8B shape (random weights) proposing k = 3 tokens, as the runner runs it
   (the head's fc over the step's rows, then three greedy draft steps over the request's rows),
   as a fraction of a target decode step (goal: at most 15%).

    python bench/spec_decode_gpu.py [--model bench/models/llama-3.1-8b] [--context 256]

Steps are built by hand for one request whose prompt is in the cache (so every step sees the same
context) and run through the model runner's ``execute_model``, alternating the two kinds; each
figure is the median of ``--steps`` timed steps after warm-up. Prints one line per figure and
writes JSON to $OUT/spec_decode_gpu.json where $OUT is set. Meant to finish within about two
minutes on an H200, engine start included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvik import LLM, SamplingParams
from kvik.request import Request
from kvik.scheduler.output import ScheduledRequest, SchedulerOutput
from kvik.spec_decode.eagle3 import Eagle3Config, Eagle3Head

ROOT = Path(__file__).resolve().parent.parent
K_VERIFY = 4
K_EAGLE = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "bench" / "models" / "llama-3.1-8b"))
    parser.add_argument("--context", type=int, default=256, help="prompt tokens in the cache")
    parser.add_argument("--steps", type=int, default=50)
    return parser.parse_args()


def synchronize() -> None:
    if torch.cuda.is_available():  # elsewhere (a CPU smoke run) everything is synchronous
        torch.cuda.synchronize()


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> int:
    args = parse_args()
    speculative = {"method": "ngram", "num_speculative_tokens": K_VERIFY, "prompt_lookup_min": 1}
    started = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=4096,
        speculative_config=speculative,
    )
    start_s = time.perf_counter() - started
    runner = llm.engine.runner
    vocab = llm.config.model.vocab_size
    block = llm.config.cache.block_size
    # The prompt's last token is the "newest token" both steps score: a decode scores it alone, a
    # verification with four drafts after it.
    prompt = [(7919 * j) % (vocab - 200) + 100 for j in range(args.context + 1)]
    request = Request("bench", prompt, SamplingParams(temperature=0.0, max_tokens=1000), 1000)
    block_ids = list(range(-(-(args.context + 1 + K_VERIFY) // block)))
    runner.execute_model(
        SchedulerOutput([ScheduledRequest(request, 0, args.context, block_ids, False)], 0)
    )
    drafts = tuple(prompt[1 : 1 + K_VERIFY])
    decode = SchedulerOutput([ScheduledRequest(request, args.context, 1, block_ids, True)], 1)
    verify = SchedulerOutput(
        [ScheduledRequest(request, args.context, 1 + K_VERIFY, block_ids, True, 0, drafts)],
        1 + K_VERIFY,
    )
    for _ in range(5):  # warm-up: graphs replayed, compiled sizes hit once
        runner.execute_model(decode)
        runner.execute_model(verify)
    step_runner = runner.step_runner
    replays = getattr(step_runner, "num_replays", 0)
    piecewise = getattr(step_runner, "num_piecewise_replays", 0)
    decode_ms = median_ms(lambda: runner.execute_model(decode), args.steps)
    verify_ms = median_ms(lambda: runner.execute_model(verify), args.steps)
    decode_ms = min(decode_ms, median_ms(lambda: runner.execute_model(decode), args.steps))
    replays = getattr(step_runner, "num_replays", 0) - replays
    piecewise = getattr(step_runner, "num_piecewise_replays", 0) - piecewise

    # The EAGLE-3 head: the runner combines the step's rows (three layers' hidden states), then
    # proposes greedily over the request's rows (kvik.spec_decode.eagle3_proposer).
    hf = llm.config.model.hf_config
    hidden = hf.hidden_size
    torch.manual_seed(0)
    draft_vocab = min(32000, vocab)  # the public Llama-3.1-8B heads' reduced vocabulary
    config = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        max_position_embeddings=4096,
    )
    device = runner.device
    head = Eagle3Head(config, runner.model.model.embed_tokens)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.02)
    head.set_vocab_map(torch.arange(draft_vocab) * (vocab // draft_vocab))
    head = head.to(device=device, dtype=torch.bfloat16)
    aux = torch.randn(1 + K_VERIFY, 3 * hidden, device=device, dtype=torch.bfloat16)
    rows = torch.randn(args.context, hidden, device=device, dtype=torch.bfloat16)
    tokens = torch.tensor(prompt[1:], device=device)

    def propose() -> None:
        with torch.inference_mode():
            head.combine(aux)
            head.propose_greedy(tokens, rows, K_EAGLE)

    for _ in range(5):
        propose()
    eagle_ms = median_ms(propose, args.steps)

    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "context": args.context,
        "engine_start_s": round(start_s, 1),
        "step_runner": step_runner.name,
        "decode_step_ms": round(decode_ms, 3),
        "verify_k4_step_ms": round(verify_ms, 3),
        "verify_over_decode": round(verify_ms / decode_ms, 3),
        "eagle3_k3_propose_ms": round(eagle_ms, 3),
        "eagle3_over_decode": round(eagle_ms / decode_ms, 3),
        "timed_full_graph_replays": replays,
        "timed_piecewise_replays": piecewise,
        "torch_version": torch.__version__,
    }
    print(
        f"batch 1, context {args.context}: decode step {decode_ms:.3f} ms, verification of "
        f"k={K_VERIFY} {verify_ms:.3f} ms = {verify_ms / decode_ms:.2f}x (goal <= 1.25x); EAGLE-3 "
        f"k={K_EAGLE} proposals {eagle_ms:.3f} ms = {100 * eagle_ms / decode_ms:.1f}% of a decode "
        f"step (goal <= 15%); step runner {step_runner.name}, {replays} full-graph and "
        f"{piecewise} piecewise replays while timed; engine start {start_s:.0f} s",
        file=sys.stderr,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "spec_decode_gpu.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
