"""The fused block-FP8 gate/up product with SiLU-and-mul (``kvik.triton_kernels.fp8_skinny_glu``)
against the two launches it replaces, on Llama-3.1-8B's gate_up (28672 x 4096) at 1 to 16 rows,
on an NVIDIA GPU: µs a layer, each in a CUDA graph over weight copies beyond four times the L2
(every weight byte from memory), median of 25 replays (``bench/fp8_gpu.py``'s timing).

Launches timed: the two launches the engine ran before (the product with the tuning's launch,
then ``silu_and_mul_fp8_group_quant``), the fused launch the engine takes (``glu_config`` of the
tuning's launch), and fused variants around it (K split 1, 2 or 4 times more or fewer ways;
2, 3 or 4 pipeline stages). Each fused launch is first checked: its e4m3 bytes and scales equal
the two launches' with the same 128-row tiles, and the split counters are back at zero.

    python3 bench/fp8_gate_up_silu_gpu.py [--rows 1,2,4,8,16] [--out f.json]

Run from the repository root with kvik installed; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gpu import DEVICE, L2_BYTES, PEAK_BYTES_PER_S, activations, graph_us  # noqa: E402

from kvik.bench.common import git_commit  # noqa: E402
from kvik.triton_kernels.activation import silu_and_mul_fp8_group_quant  # noqa: E402
from kvik.triton_kernels.attention import device_arch  # noqa: E402
from kvik.triton_kernels.fp8_linear import fp8_block_linear_quantized  # noqa: E402
from kvik.triton_kernels.fp8_quant import per_token_group_quant_fp8  # noqa: E402
from kvik.triton_kernels.fp8_skinny import Fp8SkinnyConfig, split_counters  # noqa: E402
from kvik.triton_kernels.fp8_skinny_glu import (  # noqa: E402
    fp8_skinny_glu_block_matmul,
    glu_config,
)
from kvik_cuda.tuning import fp8_block_config  # noqa: E402

INTER, K = 14336, 4096


def variants(engine: Fp8SkinnyConfig) -> dict[str, Fp8SkinnyConfig]:
    """The engine's fused launch and its neighbours (equal K runs only: ``even_split``)."""
    out = {"engine": engine}
    for split in (engine.split_k // 2, engine.split_k * 2, engine.split_k * 4):
        if split >= 1 and (K // 128) % split == 0:
            out[f"split {split}"] = dataclasses.replace(engine, split_k=split)
    for stages in (2, 3, 4):
        if stages != engine.num_stages:
            out[f"stages {stages}"] = dataclasses.replace(engine, num_stages=stages)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    arch = device_arch(DEVICE)[0]
    n = 2 * INTER
    copies = max(1, triton.cdiv(4 * L2_BYTES, n * K))
    weights = [
        (
            (torch.randn(n, K, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
            torch.rand(n // 128, K // 128, device=DEVICE) * 1e-3 + 1e-4,
        )
        for _ in range(copies)
    ]
    records, failures = [], 0
    for m in [int(r) for r in args.rows.split(",")]:
        q, scales = per_token_group_quant_fp8(activations(m, K), column_major_scales=True)
        table = fp8_block_config(arch, m, n, K)
        if not isinstance(table, Fp8SkinnyConfig):
            print(f"{m} rows: the tuning picks {table}, not the few-rows kernel; skipped")
            continue

        def two_launches(config=table, q=q, scales=scales):
            return [
                silu_and_mul_fp8_group_quant(
                    fp8_block_linear_quantized(q, scales, w, s, None, torch.bfloat16, config)
                )[0]
                for w, s in weights
            ]

        before, _, _ = graph_us(two_launches, copies)
        line = {"rows": m, "two_launches_us": before, "table": str(table), "fused": {}}
        for name, config in variants(glu_config(table, K)).items():
            w, s = weights[0]
            fused = fp8_skinny_glu_block_matmul(q, scales, w, s, None, torch.bfloat16, config)
            plain = silu_and_mul_fp8_group_quant(
                fp8_block_linear_quantized(q, scales, w, s, None, torch.bfloat16, config)
            )
            same = torch.equal(fused[0].view(torch.uint8), plain[0].view(torch.uint8))
            same = same and torch.equal(fused[1], plain[1])
            same = same and not bool(split_counters(DEVICE).any())
            if not same:
                failures += 1
                line["fused"][name] = {"config": str(config), "ok": False}
                print(f"{m} rows, {name} {config}: FAILED (not the two launches' bits)")
                continue

            def one_launch(config=config, q=q, scales=scales):
                return [
                    fp8_skinny_glu_block_matmul(q, scales, w, s, None, torch.bfloat16, config)[0]
                    for w, s in weights
                ]

            us, _, outs = graph_us(one_launch, copies)
            # The graph's replays wrote what the eager launch does and left the counters at zero.
            if not torch.equal(outs[0].view(torch.uint8), fused[0].view(torch.uint8)) or bool(
                split_counters(DEVICE).any()
            ):
                failures += 1
                line["fused"][name] = {"config": str(config), "ok": False}
                print(f"{m} rows, {name} {config}: FAILED on graph replay")
                continue
            share = n * K / (us * 1e-6) / PEAK_BYTES_PER_S
            line["fused"][name] = {"config": str(config), "ok": True, "us": us, "of_bw": share}
            print(
                f"{m} rows: two launches {before:.1f} µs; fused {name} {us:.1f} µs "
                f"({share:.1%} of {PEAK_BYTES_PER_S / 1e12:.2f} TB/s) {config}"
            )
        records.append(line)
    result = {"commit": git_commit(), "device": torch.cuda.get_device_name(DEVICE), "rows": records}
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = os.path.join(os.environ["OUT"], "fp8_gate_up_silu_gpu.json")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
