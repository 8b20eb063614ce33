"""The fused MoE op alone on a CUDA GPU at Qwen3-30B-A3B's expert shapes, bf16 and block FP8
(issue 16's op goals), in one call of well under two minutes on an H200:

    python bench/moe_gpu.py [--tokens 1,8,64,4096] [--dtypes bfloat16,fp8] [--sets 8] [--json F]
        [--profile]

Shapes: hidden 2048, 128 experts, 8 routed per token (renormalised), expert intermediate 768.
Random experts (normal, std fan_in**-0.5); the FP8 experts are those weights quantized to e4m3 with
one scale per 128 x 128 tile (Qwen3-30B-A3B-FP8's layout); random hidden states and router logits
(routing close to uniform, as with unrelated tokens).

1. Correctness first, at every token count: the op (``torch.ops.kvik.fused_moe`` and
   ``...fused_moe_fp8_block``, kvik_cuda's Triton kernels) against core's PyTorch references on
   the same GPU with fp32 inputs (bf16: ``kvik.ops`` on the upcast weights; FP8: the same e4m3
   experts, the activations quantized per token group); relative error of the whole output
   (norm of the difference over the reference's) below 1e-2 for bf16 (bf16 storage) and 3e-2
   for FP8 (its gated activations rounded to bf16 and then to e4m3, which moves some to the
   other e4m3 neighbour). A failed check is printed, recorded and makes the
   exit status 1, and that case is still timed.
2. Timing: CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median) of the op over
   --sets input sets in turn, so that the experts a call touches change from call to call and the
   60 MB L2 does not keep them between calls; the figure is per call.

Figures: at decode token counts (<= 64) the GB/s of the expert weights a call touches (distinct
experts routed to, times 3 * I * H weights, plus FP8's tile scales) and its fraction of the H200's
4.28 TB/s copy bandwidth (issue 16: >= 60%); at prefill counts the TFLOP/s (6 * M * k * I * H) and
its fraction of 790 TFLOP/s for bf16 (issue 16: >= 50% at 4096) and of 1451 TFLOP/s (fp8
``_scaled_mm``) for FP8. The JSON goes to $OUT/moe_gpu.json where OUT is set, and to --json.

--profile adds each case's kernels (``torch.profiler``, 20 eager calls): µs a call per kernel
name, so the launches around the grouped GEMMs show.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from kvik.quantization.fp8_reference import quantize_weight_blocks

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
COPY_TB_S = 4.28
PEAK_TFLOP_S = {"bfloat16": 790.0, "fp8": 1451.0}
TOLERANCE = {"bfloat16": 1e-2, "fp8": 3e-2}
DECODE_MAX_TOKENS = 64


class Experts:
    """One dtype's experts, the op that runs them and the reference it is checked against."""

    def __init__(self, name: str, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.name = name
        if name == "bfloat16":
            self.tensors = (w13, w2)
            self.bytes_per_expert = 3 * INTER * HIDDEN * 2
        else:
            q13, s13 = quantize_weight_blocks(w13)
            q2, s2 = quantize_weight_blocks(w2)
            self.tensors = (q13, s13, q2, s2)
            self.bytes_per_expert = 3 * INTER * HIDDEN + 4 * (s13[0].numel() + s2[0].numel())

    def __call__(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.name == "bfloat16":
            return torch.ops.kvik.fused_moe(hidden, logits, *self.tensors, TOP_K, True)
        return torch.ops.kvik.fused_moe_fp8_block(hidden, logits, *self.tensors, TOP_K, True)

    def reference(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        from kvik import ops
        from kvik.quantization import fp8_moe

        hidden, logits = hidden.float(), logits.float()
        if self.name == "bfloat16":
            w13, w2 = (w.float() for w in self.tensors)
            return ops._fused_moe(hidden, logits, w13, w2, TOP_K, True)
        return fp8_moe.fused_moe_fp8_block(hidden, logits, *self.tensors, TOP_K, True)

    def configs(self, tokens: int) -> list[list[int]]:
        from kvik.triton_kernels.attention import device_arch
        from kvik.triton_kernels.fused_moe import moe_configs

        dtype = self.tensors[0].dtype
        arch = device_arch(torch.device("cuda"))[0]
        chosen = moe_configs(arch, tokens, EXPERTS, INTER, HIDDEN, TOP_K, dtype)
        return [list(vars(c).values()) for c in chosen]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_case(experts: Experts, tokens: int, sets: int, generator: torch.Generator) -> dict:
    from triton.testing import do_bench_cudagraph

    from kvik.ops import moe_routing

    inputs = [
        (
            torch.randn(tokens, HIDDEN, device="cuda", generator=generator).bfloat16(),
            torch.randn(tokens, EXPERTS, device="cuda", generator=generator).bfloat16(),
        )
        for _ in range(sets)
    ]
    hidden, logits = inputs[0]
    error = relative_error(experts(hidden, logits), experts.reference(hidden, logits))
    touched = sum(moe_routing(lg, TOP_K, True)[1].unique().numel() for _, lg in inputs) / sets

    def all_sets() -> None:
        for h, lg in inputs:
            experts(h, lg)

    ms = do_bench_cudagraph(all_sets, rep=100, return_mode="median") / sets
    weight_bytes = touched * experts.bytes_per_expert
    flops = 6 * tokens * TOP_K * INTER * HIDDEN
    record = {
        "dtype": experts.name, "tokens": tokens, "configs": experts.configs(tokens),
        "relative_error": error, "correct": error < TOLERANCE[experts.name], "us": ms * 1e3,
        "experts_touched": touched, "weight_gb_s": weight_bytes / ms / 1e6,
        "tflop_s": flops / ms / 1e9,
    }  # fmt: skip
    record["bandwidth_fraction"] = record["weight_gb_s"] / (COPY_TB_S * 1e3)
    record["flop_fraction"] = record["tflop_s"] / PEAK_TFLOP_S[experts.name]
    return record


def kernel_times(experts: Experts, tokens: int, generator: torch.Generator) -> dict[str, float]:
    """µs a call of each kernel the op launches (summed by name), over 20 profiled calls."""
    from torch.profiler import ProfilerActivity, profile

    hidden = torch.randn(tokens, HIDDEN, device="cuda", generator=generator).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=generator).bfloat16()
    calls = 20
    experts(hidden, logits)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            experts(hidden, logits)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            times[event.key] = times.get(event.key, 0.0) + event.self_device_time_total / calls
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def print_row(r: dict) -> None:
    if r["tokens"] <= DECODE_MAX_TOKENS:
        figure = f"{r['weight_gb_s']:8.0f} GB/s  {100 * r['bandwidth_fraction']:5.1f}% of copy"
    else:
        figure = f"{r['tflop_s']:8.1f} TFLOP/s  {100 * r['flop_fraction']:5.1f}% of peak"
    check = "ok" if r["correct"] else "WRONG"
    print(
        f"{r['dtype']:>9} M={r['tokens']:<5} {r['us']:9.1f} us  {figure}   "
        f"experts {r['experts_touched']:5.1f}  rel.err {r['relative_error']:.1e} {check}  "
        f"tiles {r['configs']}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tokens", default="1,8,64,4096")
    parser.add_argument("--dtypes", default="bfloat16,fp8")
    parser.add_argument("--sets", type=int, default=8, help="input sets timed in turn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the records here")
    parser.add_argument("--profile", action="store_true", help="also time each kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_gpu.py needs a CUDA GPU")
    dtypes = args.dtypes.split(",")
    if unknown := set(dtypes) - set(PEAK_TFLOP_S):
        raise SystemExit(f"unknown --dtypes {sorted(unknown)}; known: {sorted(PEAK_TFLOP_S)}")
    from kvik_cuda.registration import register_kernels

    register_kernels()
    start = time.monotonic()
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=generator)
    w13 = (w13 * HIDDEN**-0.5).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=generator) * INTER**-0.5
    w2 = w2.bfloat16()
    records = []
    for name in dtypes:
        experts = Experts(name, w13, w2)
        for tokens in (int(t) for t in args.tokens.split(",")):
            records.append(run_case(experts, tokens, args.sets, generator))
            print_row(records[-1])
            if args.profile:
                records[-1]["kernel_us"] = kernel_times(experts, tokens, generator)
                for name, us in records[-1]["kernel_us"].items():
                    print(f"    {us:8.2f} us  {name}", flush=True)
    result = {
        "workload": "gpu-fused-moe-op",
        "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "intermediate": INTER},
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": time.monotonic() - start,
        "records": records,
    }
    text = json.dumps(result, indent=1) + "\n"
    for path in [args.json, os.environ.get("OUT") and Path(os.environ["OUT"]) / "moe_gpu.json"]:
        if path:
            Path(path).write_text(text)
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
