"""``--kv-cache-dtype fp8`` on a CUDA GPU through the Triton backend; skipped without CUDA.

The random-weight Llama and Qwen3 of test_gpu_e2e.py, with calibrated per-layer k/v scales in the
checkpoint, run with a bf16 and an FP8 KV cache, eagerly and in FULL CUDA graphs (which replay
with the scales' device tensors): greedy tokens agree within the FP8 rounding rule of
tests/test_fp8_kv_cache.py. A profiled cache holds about twice the blocks of a bf16 one.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

# Helpers from test_gpu_e2e.py beside this file and from the repository's top-level tests/.
sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[3] / "tests"),
]
from test_fp8_kv_cache import (  # noqa: E402
    MAX_LOGPROB_SHIFT,
    assert_tokens_within_fp8_rounding,
    calibrated_scales,
    fp8_logprob_shifts,
    with_tensors,
)
from test_gpu_e2e import (  # noqa: E402
    _free_gpu_memory,  # noqa: F401 (a fixture)
    build_model_on_gpu,
    make_llm,
    models,  # noqa: F401 (a fixture)
)
from tiny_models import ragged_prompts  # noqa: E402

from kvik import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODES = {
    "eager": dict(enforce_eager=True),
    "full-graphs": dict(cudagraph_mode="full"),
}


@pytest.fixture(scope="module")
def scaled_models(tmp_path_factory):
    """The GPU test models, initialised at 0.05 rather than 0.1, with calibrated FP8 KV cache
    scales in their checkpoints. At 0.1 keys are so large that the FP8 rounding moves attention
    enough to part every prompt's greedy tokens from the bf16 cache's within 12 tokens, on the
    CPU backend as well (largest logprob shift 0.75 nats there; 0.1 at 0.05)."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            source = build_model_on_gpu(
                kind, tmp_path_factory.mktemp(f"gpu-{kind}-init-0.05"), initializer_range=0.05
            )
            folder = tmp_path_factory.mktemp(f"fp8-{kind}") / kind
            made[kind] = with_tensors(source, folder, calibrated_scales(source))
        return made[kind]

    return make


PROMPTS = ragged_prompts(8, seed=2)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _free_cuda_memory() -> None:
    """After the caller dropped its engine: what it held goes back to the device."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def cpu_shift(scaled_models):
    """The largest logprob shift the CPU backend's FP8 cache causes on the same checkpoint in
    bf16: the yardstick for the GPU's (how far FP8 keys move logprobs depends on the model's
    scale, so a bound fixed for the CPU tests' tiny models need not fit these)."""
    made: dict[str, float] = {}

    def get(kind: str) -> float:
        if kind not in made:
            outputs = {}
            for cache_dtype in ("auto", "fp8"):
                llm = LLM(
                    str(scaled_models(kind)), device="cpu", dtype="bfloat16", num_kv_blocks=256,
                    max_num_batched_tokens=64, max_model_len=512, kv_cache_dtype=cache_dtype,
                )  # fmt: skip
                outputs[cache_dtype] = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
                llm.shutdown()
            made[kind] = max(fp8_logprob_shifts(outputs["auto"], outputs["fp8"])[0])
        return made[kind]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp8_cache_generates_the_tokens_of_the_bf16_cache(kind, mode, scaled_models, cpu_shift):
    folder = scaled_models(kind)
    outputs = {}
    for cache_dtype in ("auto", "fp8"):
        llm = make_llm(
            folder, "bfloat16", max_num_batched_tokens=64, kv_cache_dtype=cache_dtype,
            **MODES[mode],
        )  # fmt: skip
        layers = list(llm.engine.runner.attention_layers.values())
        want = torch.float8_e4m3fn if cache_dtype == "fp8" else torch.bfloat16
        assert all(layer.kv_cache.dtype == want for layer in layers)
        assert all(layer.impl.k_scale.device.type == "cuda" for layer in layers)
        outputs[cache_dtype] = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        del llm
        _free_cuda_memory()
    # The GPU's bf16 sums differ from the CPU's, so its shifts may be somewhat larger; a wrong
    # scale or a misread FP8 block moves logprobs by whole nats.
    bound = max(MAX_LOGPROB_SHIFT, 2 * cpu_shift(kind))
    assert_tokens_within_fp8_rounding(outputs["auto"], outputs["fp8"], max_shift=bound)


def test_a_profiled_fp8_cache_holds_twice_the_blocks(models):  # noqa: F811
    blocks = {}
    for cache_dtype in ("auto", "fp8"):
        llm = make_llm(
            models("llama"), "bfloat16", num_kv_blocks=None, gpu_memory_utilization=0.03,
            max_num_batched_tokens=2048, kv_cache_dtype=cache_dtype,
        )  # fmt: skip
        blocks[cache_dtype] = llm.engine.num_kv_blocks
        # The next engine profiles what is free: this one's cache must be gone first.
        del llm
        _free_cuda_memory()
    ratio = blocks["fp8"] / blocks["auto"]
    assert 1.9 <= ratio <= 2.1, blocks
