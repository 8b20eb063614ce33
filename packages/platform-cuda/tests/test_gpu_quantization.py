"""Quantized models on a CUDA GPU (skipped without one): online FP8 through the engine, eager and
in FULL CUDA graphs, computing what the CPU computes for the same checkpoint, and the unquantized
layers' kernels chosen by the platform (the one-row GEMV on Hopper)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.layers.linear import Linear
from kvik.quantization.fp8_methods import OnlineFp8LinearMethod
from kvik.triton_kernels.attention import device_arch
from kvik_cuda.linear import OneRowGemvKernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 256
PROMPT = [1, *torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.05,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def logprobs(llm: LLM) -> torch.Tensor:
    """Teacher-forced log-probabilities of PROMPT's positions, [len - 1, vocab]."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    rows = []
    for entry in out.prompt_logprobs[1:]:
        row = torch.full((VOCAB,), float("-inf"))
        for token, logprob in entry.items():
            row[token] = logprob.logprob
        rows.append(row)
    return torch.stack(rows)


def test_online_fp8_on_the_gpu_computes_what_the_cpu_does(llama):
    options = dict(
        dtype="float32", quantization="fp8", num_kv_blocks=64, max_model_len=256, max_logprobs=-1
    )
    cpu = logprobs(LLM(str(llama), device="cpu", **options))
    plain = logprobs(
        LLM(str(llama), device="cpu", dtype="float32", num_kv_blocks=64, max_logprobs=-1)
    )
    gpu_llm = LLM(str(llama), device="cuda", **options)
    layers = [m for m in gpu_llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.quant_method, OnlineFp8LinearMethod) for m in layers)
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight.is_cuda for m in layers)
    gpu = logprobs(gpu_llm)
    # The GPU and the CPU compute the unquantized model alike (0.0000 apart on the H200); with FP8,
    # Hopper's tensor cores add a group's 128 products with fewer bits than fp32 (the GEMMs'
    # results are ~1e-3 off the exact sums: fp8_kernel_cases on the H200), which flips some
    # roundings of the next layer's quantization. Measured on the H200 over three prompts:
    # 0.39-0.41 of what FP8 itself changes; a wrong scale or layout gives 1 and more.
    fp8_effect = (cpu - plain).abs().mean()
    assert (gpu - cpu).abs().mean() < 0.6 * fp8_effect
    # Decode steps replay FULL CUDA graphs with the FP8 layers inside.
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (out,) = gpu_llm.generate([{"prompt_token_ids": PROMPT[:9]}], greedy, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16


def test_hopper_unquantized_layers_take_the_platform_gemv(llama):
    llm = LLM(str(llama), device="cuda", dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    model = llm.engine.runner.model
    arch, _ = device_arch(next(model.parameters()).device)
    kernels = {
        name: type(m.quant_method.kernel).__name__
        for name, m in model.named_modules()
        if isinstance(m, Linear)
    }
    on_gemv = {name for name, kernel in kernels.items() if kernel == OneRowGemvKernel.__name__}
    # K <= 8192 everywhere in this model: every projection on Hopper, none elsewhere.
    assert on_gemv == (set(kernels) if arch == "sm90" else set())
    # The LM head is no Linear: cuBLAS, writing fp32 logits where torch's mm takes an out_dtype.
    lm_head = type(model.lm_head.quant_method.kernel).__name__
    expected = "Fp32LogitsKernel" if hasattr(torch.ops.aten.mm, "dtype") else "TorchLinearKernel"
    assert lm_head == expected


@pytest.mark.parametrize("mode", ["eager", "full"])
def test_fused_activation_quantization_computes_what_the_projections_did(
    tmp_path, monkeypatch, mode
):
    """A block-FP8 checkpoint with the Triton RMSNorm and SiLU-and-mul writing the projections'
    quantized input (KVIK_FUSED_ACTIVATION_QUANT) against the projections quantizing it: the
    same greedy tokens and teacher-forced logprobs to rounding (fp32 activations), eagerly and
    in FULL CUDA graphs."""
    import sys

    import kvik_cuda.tuning

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "quantization"))
    from fp8_checkpoints import build_original, make_hf_block_fp8

    folder = make_hf_block_fp8(build_original("llama", tmp_path / "orig"), tmp_path / "fp8")
    options = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, max_logprobs=-1)
    options |= dict(enforce_eager=True) if mode == "eager" else dict(cudagraph_mode="full")
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(kvik_cuda.tuning, "FUSED_ACTIVATION_QUANT", fused)
        llm = LLM(str(folder), device="cuda", **options)
        assert (llm.engine.runner.quantizing_producers > 0) == fused
        (out,) = llm.generate([{"prompt_token_ids": PROMPT[:9]}], greedy, use_tqdm=False)
        results[fused] = (logprobs(llm), list(out.outputs[0].token_ids))
        del llm
        gc.collect()
    assert results[True][1] == results[False][1]
    fused_logprobs, plain_logprobs = results[True][0], results[False][0]
    finite = plain_logprobs.isfinite()
    assert torch.equal(finite, fused_logprobs.isfinite())
    assert (fused_logprobs[finite] - plain_logprobs[finite]).abs().max() < 1e-3
