"""One-row bf16 products on an NVIDIA GPU: cuBLAS (``F.linear``) against kvik's one-row Triton GEMV
(``kvik.triton_kernels.gemv``) in its two tilings, over the shapes of a batch-1 step of
Llama-3.1-8B and of an EAGLE-3 head of that size (its fc over three hidden states, its q/k/v
over two, its 32k-row LM head). Each product runs in a CUDA graph over enough weight copies to
exceed the L2 cache four times (every weight byte from memory), median of 25 replays, after a
check against ``F.linear`` (relative error 1e-2). Prints µs a product and the share of 4.28 TB/s,
and which kernel ``kvik_cuda.tuning.gemv_config`` picks for the shape.

    python3 bench/one_row_gpu.py [--shapes head|llama|all]   # JSON to $OUT/one_row_gpu.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from fp8_gpu import L2_BYTES, PEAK_BYTES_PER_S, graph_us

from kvik.triton_kernels.gemv import GemvConfig, gemv
from kvik_cuda.tuning import gemv_config

#: (name, out_features, in_features)
LLAMA = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
HEAD = [
    ("head fc", 4096, 12288),
    ("head qkv", 6144, 8192),
    ("head lm_head", 32000, 4096),
]
TILINGS = {
    "gemv narrow (8 x 512)": GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=3),
    "gemv wide (32 x 256)": GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=["head", "llama", "all"], default="all")
    args = parser.parse_args()
    shapes = {"head": HEAD, "llama": LLAMA, "all": LLAMA + HEAD}[args.shapes]
    torch.manual_seed(0)
    records = []
    for name, n, k in shapes:
        weight_bytes = n * k * 2
        copies = max(2, -(-4 * L2_BYTES // weight_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02]
        weights += [weights[0].clone() for _ in range(copies - 1)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x.float(), weights[0].float())
        kernels = {"cuBLAS": lambda w, x=x: F.linear(x, w)}
        for label, config in TILINGS.items():
            kernels[label] = lambda w, x=x, config=config: gemv(x, w, None, config)
        picked = gemv_config("sm90", n, k)
        for label, product in kernels.items():
            got = product(weights[0]).float()
            error = ((got - expected).norm() / expected.norm()).item()
            if error > 1e-2:
                print(f"{name} {label}: relative error {error:.2e}: not timed")
                continue
            us, _, _ = graph_us(lambda p=product, ws=weights: [p(w) for w in ws], copies)
            share = weight_bytes / (us * 1e-6) / PEAK_BYTES_PER_S
            records.append(
                {"shape": name, "n": n, "k": k, "kernel": label, "us": round(us, 2),
                 "of_bandwidth": round(share, 3)}
            )  # fmt: skip
            print(f"{name:>14} {n:>6} x {k:<6} {label:<22} {us:7.2f} µs  {share:6.1%}")
        print(f"{name:>14}: gemv_config picks {picked}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "one_row_gpu.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=2)


if __name__ == "__main__":
    main()
