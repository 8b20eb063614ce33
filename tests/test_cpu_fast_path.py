"""The CPU's fast path computes what the references do: the C++ kernels of the small ops against
kvik.ops' PyTorch references, prepacked bf16 weights against F.linear, and the engine's fallback
when the C++ kernels cannot be built. Tests of what differs between the kernel paths (plain,
avx512bf16, amx: kvik_cpu.isa) run on each path this CPU can run (tests/cpu_paths.py), and a path
it cannot run is skipped with the reason. (The engine's fp32 equality with transformers,
test_engine_vs_transformers.py, runs on the C++ kernels; the default model's bf16 checks on each
path are in test_default_model.py.)"""

from __future__ import annotations

import cpu_paths
import pytest
import torch
import torch.nn.functional as F
from test_engine_vs_transformers import assert_greedy_equal
from tiny_models import load_hf, ragged_prompts

import kvik.ops as ops
from kvik import LLM, SamplingParams
from kvik.layers.linear import Linear
from kvik.quantization.kernels import TorchLinearKernel
from kvik_cpu import extension, isa
from kvik_cpu.isa import CpuIsa
from kvik_cpu.linear import (
    AmxLinear,
    Avx512Bf16Linear,
    OneDnnLinear,
    avx512_bf16_linear_runs,
    packed_linear_supported,
)
from kvik_cpu.paged_attention import CpuPagedBackend, CpuPagedImpl

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_kernels = pytest.mark.skipif(
    extension.load() is not None, reason=f"kvik_cpu's C++ ops did not build: {extension.load()}"
)

cpu_path = cpu_paths.cpu_path  # the fixture: each kernel path this CPU runs


def assert_same(got, want, dtype):
    """The kernels round where the references round, but sum in another order and fuse
    multiply-adds: fp32 agrees to its last bits, bf16 and fp16 to one unit in the last place, and
    nearly every element has the same bits."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=eps, atol=eps if dtype != torch.float32 else 1e-6)
    if dtype != torch.float32:
        assert (got != want).float().mean() < 0.01


def rows(n: int, width: int, dtype, padded: bool) -> torch.Tensor:
    """Fresh random rows; ``padded`` makes them a strided view, as qkv's split gives."""
    x = torch.randn(n, width + (7 if padded else 0)).to(dtype)
    return x[:, :width] if padded else x


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 5, 70])
def test_norm_and_activation_kernels_equal_the_references(dtype, num_tokens):
    torch.manual_seed(num_tokens)
    x, residual = rows(num_tokens, 96, dtype, True), rows(num_tokens, 96, dtype, False)
    weight = torch.randn(96).to(dtype)
    assert_same(torch.ops.kvik.rms_norm(x, weight, 1e-6), ops._rms_norm(x, weight, 1e-6), dtype)
    for got, want in zip(
        torch.ops.kvik.fused_add_rms_norm(x, residual, weight, 1e-5),
        ops._fused_add_rms_norm(x, residual, weight, 1e-5),
    ):
        assert_same(got, want, dtype)
    gate_up = rows(num_tokens, 2 * 80, dtype, True)
    assert_same(torch.ops.kvik.silu_and_mul(gate_up), ops._silu_and_mul(gate_up), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_silu_kernel_gives_the_reference_bits_for_every_gate(dtype):
    """silu(gate) * up is one fp32 expression rounded after the activation and after the product,
    with no sum whose order could differ: the kernel must give the reference's bits for every
    finite gate of the dtype (all 2^16 bit patterns), with up = 1 (the activation alone) and with
    fresh random ups. Built with -ffast-math, the kernel divided by an approximate reciprocal: NaN
    for every gate below -89 (the reciprocal of exp(89) = inf), and silu(5.9375) rounded up in bf16
    (5.9375 where the exact 5.92187443... rounds to 5.90625), which turned the default model's
    answer to "What is the capital of France?" from Paris to "L'Étoile, ..." in bf16 without AMX."""
    torch.manual_seed(0)
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    gate = gate[torch.isfinite(gate.float())]
    for up in (torch.ones_like(gate), torch.randn(gate.shape).to(dtype)):
        gate_up = torch.cat([gate, up]).view(1, -1)
        got, want = torch.ops.kvik.silu_and_mul(gate_up)[0], ops._silu_and_mul(gate_up)[0]
        differ = got.view(torch.int16) != want.view(torch.int16)
        assert not differ.any(), (
            f"{int(differ.sum())} gates differ, e.g. {gate[differ][:8].tolist()}: "
            f"kernel {got[differ][:8].tolist()}, reference {want[differ][:8].tolist()}"
        )


@needs_kernels
def test_silu_kernel_in_float32_is_finite_where_the_reference_is():
    gate = torch.cat([torch.linspace(-1e4, 1e4, 20001), torch.linspace(-100, 100, 20001)])
    gate_up = torch.cat([gate, torch.randn(gate.shape)]).view(1, -1)
    got, want = torch.ops.kvik.silu_and_mul(gate_up)[0], ops._silu_and_mul(gate_up)[0]
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=4 * torch.finfo(torch.float32).eps, atol=1e-30)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # 16 < head size: partial rotary
def test_rotary_kernel_equals_the_reference(dtype, is_neox, rot_dim):
    torch.manual_seed(rot_dim)
    head_size, tokens = 32, 9
    qkv = torch.randn(tokens, (4 + 2 + 2) * head_size).to(dtype)
    q, k, _ = qkv.split([4 * head_size, 2 * head_size, 2 * head_size], dim=-1)  # strided views
    positions = torch.randint(0, 500, (tokens,))
    cos_sin = torch.randn(512, rot_dim)
    got = torch.ops.kvik.rotary_embedding(positions, q, k, head_size, cos_sin, is_neox)
    want = ops._rotary_embedding(positions, q, k, head_size, cos_sin, is_neox)
    for g, w in zip(got, want):
        assert_same(g, w, dtype)


@pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_onednn_linear_equals_f_linear(num_rows):
    torch.manual_seed(num_rows)
    weight = torch.randn(96, 80, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    x = torch.randn(num_rows, 80, dtype=torch.bfloat16)
    for b in (None, bias):
        assert torch.equal(OneDnnLinear(weight, b)(x), F.linear(x, weight, b))
    assert OneDnnLinear(weight, None)(x[:0]).shape == (0, 96)


def _amx_unavailable() -> str | None:
    """Why the amx path cannot run here (None where it can): the CPU, the build, or Linux."""
    if isa.cpu_isa() < CpuIsa.AMX:
        return "no AMX on this CPU"
    if (failure := extension.load()) is not None:
        return f"kvik_cpu's C++ ops did not build: {failure}"
    if torch.ops.kvik_cpu.built_isa() < CpuIsa.AMX:
        return "AMX flags, but the build or Linux does not let this process use the tiles"
    return None


needs_amx = pytest.mark.skipif(_amx_unavailable() is not None, reason=str(_amx_unavailable()))


@needs_amx
@pytest.mark.parametrize(
    "out_features, in_features",
    [(96, 64), (100, 80), (960, 576), (33, 1536), (16, 32)],  # N and K off the tiles' multiples too
)
@pytest.mark.parametrize("num_rows", [1, 7, 16, 17, 32, 45, 100])
def test_amx_linear_matches_a_float64_product(num_rows, out_features, in_features):
    """fp32 sums of exact bf16 products, rounded once to bf16: within bf16's rounding of the exact
    result (plus fp32's summation error), with and without a bias."""
    torch.manual_seed(num_rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    x = torch.randn(num_rows, in_features, dtype=torch.bfloat16)
    for b in (None, bias):
        got = AmxLinear(weight, b)(x)
        want = x.double() @ weight.double().T + (0 if b is None else b.double())
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        limit = want.abs() * 2**-8 + 1e-5 * in_features**0.5
        assert ((got.double() - want).abs() <= limit).all()


@needs_amx
def test_amx_linear_gives_a_row_the_same_bits_at_any_batch_size():
    """Decode tokens meet the same kernel whether alone, in a batch or beside a prefill."""
    torch.manual_seed(0)
    weight = torch.randn(200, 96, dtype=torch.bfloat16)
    linear = AmxLinear(weight, torch.randn(200, dtype=torch.bfloat16))
    x = torch.randn(70, 96, dtype=torch.bfloat16)
    full = linear(x)
    for start, stop in [(0, 1), (5, 6), (3, 40), (33, 70)]:
        assert torch.equal(linear(x[start:stop]), full[start:stop])
    assert linear(x[:0]).shape == (0, 200)
    assert linear(x.view(7, 10, 96)).shape == (7, 10, 200)  # leading dims kept


#: The matmul kernel each path packs the weights for (None: F.linear on the dense weight).
PATH_KERNEL = {
    CpuIsa.PLAIN: None,
    CpuIsa.AVX512BF16: Avx512Bf16Linear if avx512_bf16_linear_runs() else OneDnnLinear,
    CpuIsa.AMX: AmxLinear,
}


@needs_kernels
def test_bf16_engine_takes_the_forced_path_and_agrees_with_transformers(tiny_model, cpu_path):
    """Each path's matmul kernels, attention kernel path and decode loop are the ones it names,
    and its greedy tokens agree with transformers in bf16."""
    from kvik_cpu.decode_layers import DecodeLayers

    folder = tiny_model("qwen2")
    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine.runner.model
    # Each layer's product, as its (unquantized) method computes it.
    kernels = [m.quant_method.kernel for m in model.modules() if hasattr(m, "quant_method")]
    expected = PATH_KERNEL[cpu_path]
    assert len(kernels) == 1 + 4 * len(model.model.layers)  # the LM head, 4 matmuls a layer
    if expected is None:
        assert all(type(k) is TorchLinearKernel for k in kernels)
    else:
        if not packed_linear_supported(torch.bfloat16):
            pytest.skip("oneDNN has no bf16 on this CPU")
        assert all(isinstance(k.packed, expected) for k in kernels)
        assert all(m.weight.numel() == 0 for m in model.modules() if isinstance(m, Linear))
    assert model.model.embed_tokens.weight.numel() > 0  # still looked up
    impls = [layer.self_attn.attn.impl for layer in model.model.layers]
    assert all(type(i) is CpuPagedImpl and i.path is cpu_path for i in impls)
    decode_layers = llm.engine.runner.step_runner.decode_layers
    # The one-call decode loop runs AMX matmuls only: the other paths decode layer by layer.
    assert isinstance(decode_layers, DecodeLayers) == (cpu_path is CpuIsa.AMX)
    prompts = ragged_prompts(3, seed=2)
    hf = load_hf(folder).to(torch.bfloat16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        # The first token from the prompt alone: transformers' best, or within a bf16 near-tie.
        first = output.outputs[0].token_ids[0]
        assert logits[first] >= logits.max() - 0.05 * logits.abs().max()


def test_engine_without_the_cpp_kernels_falls_back_to_the_references(tiny_model, monkeypatch):
    """Where the C++ ops cannot be built (no compiler, say), the engine runs the references
    directly and attends with TORCH_SDPA, computing the same tokens."""
    monkeypatch.setattr(extension, "load", lambda: "RuntimeError: no C++ compiler here")
    folder = tiny_model("mistral")  # a sliding window, GQA
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=256)
    assert llm.engine.runner.backend is not CpuPagedBackend
    assert llm.engine.runner.backend.name == "TORCH_SDPA"
    assert llm.engine.platform.ops_dispatch == "direct" == llm.config.ops_dispatch
    prompts = ragged_prompts(4, seed=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert_greedy_equal(prompts, outputs, load_hf(folder), GREEDY.max_tokens)


@needs_amx
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])  # llama3 rope, a window, biases
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode_layers_compute_the_bits_of_the_layer_by_layer_path(
    tiny_model, kind, kv_cache_dtype
):
    """kvik_cpu.decode_layers runs a decode step's layers in one C++ call of the same kernels:
    tokens and logprobs equal the layer-by-layer path's exactly (an FP8 KV cache included: the
    loop passes each layer's k and v scales to the same attention kernel)."""
    from kvik_cpu.decode_layers import DecodeLayers

    folder = tiny_model(kind)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in ragged_prompts(4, seed=3)]
    results = []
    for fused in (True, False):
        llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
        step_runner = llm.engine.runner.step_runner
        assert isinstance(step_runner.decode_layers, DecodeLayers)
        ran: list = []
        if fused:
            step_runner.decode_layers = counting(step_runner.decode_layers, ran)
        else:
            step_runner.decode_layers = None
        outputs = llm.generate(prompts, params)
        assert not fused or sum(out is not None for out in ran) >= params.max_tokens - 1
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert results[0] == results[1]


class counting:
    """``kernel`` (a ``DecodeLayers``), recording what each call returns (None: the step ran
    layer by layer); its other attributes are the kernel's (the step runner reads ``stack``)."""

    def __init__(self, kernel, results: list) -> None:
        self._kernel = kernel
        self._results = results

    def __call__(self, hidden, positions, metadata):
        self._results.append(self._kernel(hidden, positions, metadata))
        return self._results[-1]

    def __getattr__(self, name: str):
        return getattr(self._kernel, name)


@needs_amx
def test_qwen3_layers_are_left_to_python(tiny_model):
    """q and k norms are not in the C++ loop: Qwen3 runs layer by layer, where a Llama on the
    same path gets the loop. (Off the amx path no model gets it: the test above checks that.)"""
    llm = LLM(str(tiny_model("qwen3")), dtype="bfloat16", num_kv_blocks=64)
    assert llm.engine.runner.step_runner.decode_layers is None
    llama = LLM(str(tiny_model("llama")), dtype="bfloat16", num_kv_blocks=64)
    assert llama.engine.runner.step_runner.decode_layers is not None
