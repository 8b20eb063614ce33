"""Speculative decoding's costs on the GPU (issue 18), at batch 1 on Llama-3.1-8B shapes (dummy
weights, bf16, the engine's default graphs):

1. a verification step (the newest token and k = 4 drafts scored in one forward, then the
   rejection sampler and the n-gram proposer) against a plain decode step of the same engine
   (goal: at most 1.25x);
2. an EAGLE-3 head of the 8B shape (random weights, bf16) proposing k = 3 tokens in a second
   engine (the head's one batched pass over the step's rows, writing its KV cache, then two
   one-row draft steps, launched behind the target's forward before the step is read back): what
   the proposals add to that engine's step after a decode step and after a verification of 3
   drafts (its step with the head less its step with the head idle), as a fraction of its target
   step (goal: at most 15%); with the head run eagerly (``KVIK_EAGLE3_DRAFT_GRAPHS=0``), then with
   its batched pass and draft steps replayed as CUDA graphs where the platform has them (the
   engine's default with FULL graphs). ``--profile`` times one proposal alone (launched from the
   step's tokens on the host, between two synchronizations) and lists its kernels.

    python bench/spec_decode_gpu.py [--model bench/models/llama-3.1-8b] [--context 256]

Steps are built by hand for one request whose prompt is in the cache (so every step sees the same
context) and run through the model runner's ``execute_model``, alternating the two kinds; each
figure is the median of ``--steps`` timed steps after warm-up. Prints one line per figure and
writes JSON to $OUT/spec_decode_gpu.json where $OUT is set. Meant to finish within about two
minutes on an H200, engine start included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvik import LLM, SamplingParams
from kvik.request import Request
from kvik.scheduler.output import ScheduledRequest, SchedulerOutput
from kvik.spec_decode.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    save_eagle3_head,
)

ROOT = Path(__file__).resolve().parent.parent
K_VERIFY = 4
K_EAGLE = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "bench" / "models" / "llama-3.1-8b"))
    parser.add_argument("--context", type=int, default=256, help="prompt tokens in the cache")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print the kernels of the EAGLE-3 proposals (graphed, after a decode step) "
        "under torch.profiler, per proposal, and the wall time they leave to the host",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help="with --profile: also write the profiled proposals' timeline (host calls and "
        "kernels) to this Chrome-trace JSON file, to see where the device waits for the host",
    )
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


def random_head(folder: Path, hf, vocab: int) -> Path:
    """An EAGLE-3 head of the target's shapes with random weights, over a reduced vocabulary of
    the public Llama-3.1-8B heads' size, saved where the engine loads it from."""
    draft_vocab = min(32000, vocab)
    layers = hf.num_hidden_layers
    config = Eagle3Config(
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
        # vLLM's default layers for the 8B; the first, middle and last of a tiny smoke-run model
        eagle_aux_hidden_state_layer_ids=default_aux_layer_ids(layers)
        if layers >= 6
        else [0, layers // 2, layers - 1],
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        head = Eagle3Head(config).to(torch.bfloat16)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.02)
    head.set_vocab_map(torch.arange(draft_vocab, device=device) * (vocab // draft_vocab))
    save_eagle3_head(head, folder)
    return folder


@contextlib.contextmanager
def proposals_off(proposer):
    """The EAGLE-3 engine's steps with its head idle: nothing launched, no drafts."""
    saved = proposer.launch, proposer.propose
    proposer.launch = lambda *given: None
    proposer.propose = lambda *given, launched=None: {}
    try:
        yield
    finally:
        proposer.launch, proposer.propose = saved


def eagle3_figures(args: argparse.Namespace, prompt: list[int], block: int) -> dict:
    """An engine with an EAGLE-3 head (k = 3): what its proposals add to a decode step and to a
    verification of k drafts, as ``execute_model`` runs them (the head launched behind the
    target's forward before the step's read-back, its drafts read back after it): the step's
    time with the head less its time with the head idle."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        head = random_head(Path(folder), hf, hf.vocab_size)
        speculative = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K_EAGLE}
        # Batch 1 needs the smallest graphs only: max_num_seqs 8 captures sizes 1, 2, 4 and 8.
        llm = engine(args, speculative, max_num_seqs=8)
        start_s = time.perf_counter() - started
    runner = llm.engine.runner
    proposer = runner.proposer
    propose = proposer.propose
    last_call: list[tuple] = []  # the arguments of the latest proposal (for --profile)

    def recorded_propose(*given, launched=None):
        last_call[:] = [given]
        return propose(*given, launched=launched)

    proposer.propose = recorded_propose
    context = args.context
    request = Request("eagle", prompt, SamplingParams(temperature=0.0, max_tokens=1000), 1000)
    block_ids = list(range(-(-(context + 1 + 2 * K_EAGLE) // block)))
    runner.execute_model(
        SchedulerOutput([ScheduledRequest(request, 0, context, block_ids, False)], 0)
    )
    decode = SchedulerOutput([ScheduledRequest(request, context, 1, block_ids, True)], 1)
    drafts = tuple(prompt[1 : 1 + K_EAGLE])
    verify = SchedulerOutput(
        [ScheduledRequest(request, context, 1 + K_EAGLE, block_ids, True, 0, drafts)], 1 + K_EAGLE
    )
    for _ in range(5):
        for step in (decode, verify):
            if not runner.execute_model(step).spec_token_ids:
                raise RuntimeError("the EAGLE-3 engine proposed nothing")
    step_runner = runner.step_runner
    replays = getattr(step_runner, "num_replays", 0)
    figures = {}
    # The head eagerly (KVIK_EAGLE3_DRAFT_GRAPHS=0), then its batched pass and draft steps
    # replayed as graphs where the platform has them (the engine's default), captured at their
    # first use here.
    graphs = runner.platform.step_graphs() if proposer.graph_sizes else None
    for prefix, draft_graphs in (("eagle3", None), ("eagle3_graphed", graphs)):
        if prefix != "eagle3" and draft_graphs is None:
            continue
        proposer.graphs = draft_graphs
        for _ in range(3):  # warm-up (and the graphs' capture)
            runner.execute_model(decode)
            runner.execute_model(verify)
        for name, step in (("decode", decode), ("verify", verify)):
            # What proposing adds to a step: the engine's step with the head and without it
            # (the target's forward with the hooks' copies, sampling, the read-back), timed in
            # turns so that a drift of the machine's speed does not fall on one side.
            with_head, idle = [], []
            for _ in range(args.steps):
                with_head.append(median_ms(lambda step=step: runner.execute_model(step), 1))
                with proposals_off(proposer):
                    idle.append(median_ms(lambda step=step: runner.execute_model(step), 1))
            step_ms, target_ms = statistics.median(with_head), statistics.median(idle)
            figures[f"{prefix}_propose_after_{name}_ms"] = round(step_ms - target_ms, 3)
            figures[f"{prefix}_engine_{name}_step_ms"] = round(step_ms, 3)
            figures[f"{prefix}_engine_{name}_target_ms"] = round(target_ms, 3)
        if draft_graphs is not None:
            figures["eagle3_head_graph_replays"] = draft_graphs.num_replays
    if args.profile:  # the last way timed: graphed where the platform has graphs
        runner.execute_model(decode)  # the proposal after a decode step, repeated below
        how = "graphed" if proposer.graphs is not None else "eager"
        profile_proposals(propose, last_call[0], args.steps, how, trace=args.trace)
        if args.trace is not None:  # and whole decode steps with the head, as the engine runs them
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities) as prof:
                for _ in range(5):
                    runner.execute_model(decode)
            prof.export_chrome_trace(str(args.trace.with_name(args.trace.stem + "_steps.json")))
    figures["eagle3_timed_full_graph_replays"] = getattr(step_runner, "num_replays", 0) - replays
    figures["eagle3_engine_start_s"] = round(start_s, 1)
    llm.shutdown()
    return figures


def profile_proposals(
    propose, given: tuple, steps: int, how: str, top: int = 20, trace: Path | None = None
) -> None:
    """The kernels of ``steps`` repeats of one proposal (the same rows and slots each time: the
    head's cache writes land where they did), per proposal, and its wall time beside them. On a
    CPU (a smoke run) the table lists the CPU's operators instead."""
    from torch.profiler import ProfilerActivity, profile

    propose = torch.inference_mode()(propose)  # as the runner calls it (execute_model's mode)
    wall_ms = median_ms(lambda: propose(*given), steps)
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    synchronize()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            propose(*given)
        synchronize()
    device = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    kernels = [e for e in prof.key_averages() if e.device_type == device]

    def self_us(e) -> float:
        return e.self_device_time_total if on_gpu else e.self_cpu_time_total

    busy_us = sum(self_us(e) for e in kernels) / steps
    print(
        f"EAGLE-3 proposal ({how}, after a decode step): {wall_ms:.3f} ms wall (median of "
        f"{steps}), {'GPU kernels' if on_gpu else 'CPU operators'} {busy_us / 1e3:.3f} ms a "
        f"proposal"
    )
    kernels.sort(key=self_us, reverse=True)
    print(f"{'kernel' if on_gpu else 'operator':<90} {'us/call':>9} {'calls/proposal':>14}")
    for e in kernels[:top]:
        print(f"{e.key[:90]:<90} {self_us(e) / steps:9.1f} {e.count / steps:14.1f}")
    if on_gpu:  # the host's side: where a proposal's wall time goes on the CPU
        host = [e for e in prof.key_averages() if e.device_type != device]
        host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        print(f"{'host call':<90} {'us/proposal':>11} {'calls/proposal':>14}")
        for e in host[:top]:
            print(f"{e.key[:90]:<90} {e.self_cpu_time_total / steps:11.1f} {e.count / steps:14.1f}")
    if trace is not None:
        prof.export_chrome_trace(str(trace))


def engine(args: argparse.Namespace, speculative: dict, **kwargs) -> LLM:
    # A KV cache of a fixed size: the two engines of the run need little, and the second must not
    # find the memory taken by the first's profiled cache.
    return LLM(
        args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        num_kv_blocks=512,
        speculative_config=speculative,
        **kwargs,
    )


def main() -> int:
    args = parse_args()
    speculative = {"method": "ngram", "num_speculative_tokens": K_VERIFY, "prompt_lookup_min": 1}
    started = time.perf_counter()
    llm = engine(args, speculative)
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
    step_runner_name = step_runner.name

    llm.shutdown()
    eagle = eagle3_figures(args, prompt, block)

    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "context": args.context,
        "engine_start_s": round(start_s, 1),
        "step_runner": step_runner_name,
        "decode_step_ms": round(decode_ms, 3),
        "verify_k4_step_ms": round(verify_ms, 3),
        "verify_over_decode": round(verify_ms / decode_ms, 3),
        **eagle,
        "timed_full_graph_replays": replays,
        "timed_piecewise_replays": piecewise,
        "torch_version": torch.__version__,
    }
    print(
        f"batch 1, context {args.context}: decode step {decode_ms:.3f} ms, verification of "
        f"k={K_VERIFY} {verify_ms:.3f} ms = {verify_ms / decode_ms:.2f}x (goal <= 1.25x); step "
        f"runner {result['step_runner']}, {replays} full-graph and {piecewise} piecewise replays "
        f"while timed; engine start {start_s:.0f} s",
        file=sys.stderr,
    )
    for prefix, how in (("eagle3", "eagerly"), ("eagle3_graphed", "as CUDA graphs (the default)")):
        if f"{prefix}_propose_after_decode_ms" not in eagle:
            continue
        added = [eagle[f"{prefix}_propose_after_{n}_ms"] for n in ("decode", "verify")]
        target = [eagle[f"{prefix}_engine_{n}_target_ms"] for n in ("decode", "verify")]
        for name, ms, of in zip(("decode", "verify"), added, target, strict=True):
            result[f"{prefix}_after_{name}_over_target"] = round(ms / of, 3)
            result[f"{prefix}_after_{name}_over_decode"] = round(ms / decode_ms, 3)
        print(
            f"EAGLE-3 k={K_EAGLE} proposals with the head {how}: they add {added[0]:.3f} ms to a "
            f"decode step = {100 * added[0] / target[0]:.1f}% of its target step "
            f"({target[0]:.3f} ms), {added[1]:.3f} ms to a verification of {K_EAGLE} drafts = "
            f"{100 * added[1] / target[1]:.1f}% of its target step ({target[1]:.3f} ms) "
            f"(goal <= 15%); {100 * added[0] / decode_ms:.1f}% of the plain decode step",
            file=sys.stderr,
        )
    print(
        f"EAGLE-3 engine: {eagle['eagle3_timed_full_graph_replays']} full-graph replays while "
        f"timed, {eagle.get('eagle3_head_graph_replays', 0)} head-graph replays",
        file=sys.stderr,
    )
    text = json.dumps(result, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "spec_decode_gpu.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
