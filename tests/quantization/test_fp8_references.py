"""The FP8 test checkpoints and their float64 reference, checked against independent readers:
transformers' own loaders (fine-grained FP8 dequantized on the CPU, compressed-tensors through
CompressedTensorsHfQuantizer and compressed-tensors' own forward), compressed-tensors'
quantization functions, and torch's e4m3 cast."""

from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import FORMATS, PLANTED_BUGS, is_quantized_projection
from fp8_reference import (
    BAR,
    FP8,
    ActivationScheme,
    ReferenceModel,
    TransformersModel,
    mean_abs_delta,
    read_checkpoint,
    round_to_e4m3,
    teacher_forced_logprobs,
)
from safetensors import safe_open

FORMAT_NAMES = list(FORMATS)


def test_e4m3_rounding_equals_torch_cast():
    """On float32 inputs (where torch's cast rounds once) the float64 emulation's rounding is
    torch's round-to-nearest-even, ties, subnormals and saturation included."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(200_000, generator=g) * 2.0 ** torch.randint(-12, 9, (200_000,), generator=g)  # fmt: skip
    # Exact ties between neighbouring e4m3 values, normal and subnormal.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    ties = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([values, ties, -ties, torch.tensor([0.0, 448.0, -448.0, 460.0, -1e4])])
    expected = values.clamp(-448, 448).to(FP8).double()
    assert torch.equal(round_to_e4m3(values.double()), expected)


def _compressed_tensors_fake_quantize(x: torch.Tensor, strategy: str, group_size=None):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=True, group_size=group_size)  # fmt: skip
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=torch.nn.Module())
    return fake_quantize(x, scale, zero_point, args)


@pytest.mark.parametrize(
    "scheme, strategy",
    [(ActivationScheme(True, 128), "group"), (ActivationScheme(True), "token")],
    ids=["per-token-group-128", "per-token"],
)
def test_dynamic_activation_rounding_equals_compressed_tensors(scheme, strategy):
    """The emulation's dynamic activation rounding against compressed-tensors' fake quantization
    (the same scheme, computed independently); in float64 both round each value once."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 17, 256, generator=g, dtype=torch.float64)
    x[..., 5] *= 40.0  # an outlier channel, so groups and tokens get different scales
    x[0, 3] = 0.0  # an all-zero token: zeros, not NaN
    expected = _compressed_tensors_fake_quantize(x, strategy, 128 if strategy == "group" else None)
    got = scheme.apply(x)
    assert torch.equal(got[0, 3], torch.zeros(256, dtype=torch.float64))
    # compressed-tensors divides in float64 too but casts through float32 (two roundings), so
    # a value within float32's precision of a tie may land on the other neighbour.
    mismatched = (got != expected).float().mean()
    assert mismatched < 1e-4
    torch.testing.assert_close(got, expected, rtol=2.0**-3, atol=0)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_checkpoint_layout(name, fp8_case):
    """Each file holds its format's documented tensors: e4m3 weights [N, K], the format's
    scales with their names, dtypes and shapes; the lm_head, embeddings and norms unquantized."""
    case = fp8_case(name)
    config = json.loads((case.folder / "config.json").read_text())
    method = config["quantization_config"]["quant_method"]
    shapes = {}
    for file in case.folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                shapes[key] = (t.get_dtype(), tuple(t.get_shape()))
    weights = {k.removesuffix(".weight"): v for k, v in shapes.items() if k.endswith(".weight")}
    quantized = {m for m, (dtype, _) in weights.items() if dtype == "F8_E4M3"}
    assert quantized == {m for m in weights if is_quantized_projection(m)}
    assert len(quantized) == 14  # 7 projections in each of 2 layers
    for module in quantized:
        n, k = weights[module][1]
        scale = {s.removeprefix(f"{module}."): v for s, v in shapes.items() if s.startswith(f"{module}.") and "scale" in s}  # fmt: skip
        if method == "fp8":
            assert scale == {"weight_scale_inv": ("F32", (n // 128, k // 128))}
        elif method == "compressed-tensors":
            dtype = "BF16" if case.kind == "qwen3" else "F32"  # the original's dtype
            if "channel" in name:
                assert scale == {"weight_scale": (dtype, (n, 1))}
            else:
                assert scale == {"weight_scale": (dtype, (1,)), "input_scale": (dtype, (1,))}
        else:
            assert method == "modelopt"
            assert scale == {"weight_scale": ("F32", ()), "input_scale": ("F32", ())}
    if method == "modelopt":
        hf_quant = json.loads((case.folder / "hf_quant_config.json").read_text())
        assert hf_quant["quantization"]["quant_algo"] == "FP8"
        assert hf_quant["producer"]["name"] == "modelopt"


@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if not n.startswith("modelopt")])
def test_transformers_reads_the_weights_the_reference_reads(name, fp8_case):
    """transformers' own loader (FineGrainedFP8 dequantizes on a CPU; compressed-tensors
    decompresses) gives every quantized projection the weight the reference dequantized."""
    case = fp8_case(name)
    model = TransformersModel(case.folder).model
    for module, layer in read_checkpoint(case.folder)[2].items():
        weight = model.get_submodule(module).weight
        assert weight.dtype == torch.float32
        torch.testing.assert_close(weight.double(), layer.dense_weight, rtol=2**-23, atol=0)


@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if n.startswith("hf-block")])
def test_transformers_block_fp8_equals_reference_without_activation_rounding(name, fp8_case):
    """On a CPU transformers runs fine-grained FP8 as dequantized weights only: the reference
    with its activation rounding off computes the same logprobs (fp32 against float64)."""
    case = fp8_case(name)
    got = teacher_forced_logprobs(TransformersModel(case.folder), case.sequences)
    torch.testing.assert_close(got, case.weights_only, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", [n for n in FORMAT_NAMES if n.startswith("ct-")])
def test_compressed_tensors_forward_agrees_with_emulation(name, fp8_case):
    """compressed-tensors' own forward through transformers' loader (the reference of these
    formats: decompressed weights, its activation fake quantization, fp32) and the float64
    emulation: each one's mean |delta logprob| against the original within the bar of the
    other's. Static scales round identically in both, so there they agree token by token too."""
    case = fp8_case(name)
    assert isinstance(case.reference_model, TransformersModel)
    emulation_error = mean_abs_delta(case.emulation, case.original)
    report = f"{name}: compressed-tensors {case.reference_error:.4f}, emulation {emulation_error:.4f}"  # fmt: skip
    assert emulation_error <= BAR * case.reference_error, report
    assert case.reference_error <= BAR * emulation_error, report
    if "static" in name:
        assert mean_abs_delta(case.emulation, case.reference) < 0.1 * case.reference_error, report


def test_modelopt_maker_quantizes_as_compressed_tensors(fp8_case):
    """The hand-written ModelOpt layout's per-tensor weights and static input scales are what
    compressed-tensors' own FP8 preset computes from the same original and calibration."""
    modelopt = read_checkpoint(fp8_case("modelopt-tensor-llama").folder)[2]
    compressed_tensors = read_checkpoint(fp8_case("ct-tensor-static-llama").folder)[2]
    assert modelopt.keys() == compressed_tensors.keys()
    for module, layer in modelopt.items():
        other = compressed_tensors[module]
        torch.testing.assert_close(layer.dense_weight, other.dense_weight, rtol=1e-6, atol=0)
        assert layer.activations.input_scale == pytest.approx(other.activations.input_scale, rel=1e-6)  # fmt: skip


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_reference_error_is_what_fp8_rounding_costs(name, fp8_case):
    """Weight rounding alone and activation rounding on top each cost the reference something,
    and not more than FP8 plausibly does: the test model is neither insensitive nor broken."""
    case = fp8_case(name)
    weights_error = mean_abs_delta(case.weights_only, case.original)
    error = mean_abs_delta(case.emulation, case.original)
    print(f"{name}: weights only {weights_error:.4f}, weights and activations {error:.4f}")
    assert 0.01 < weights_error < error < 0.3


@pytest.mark.parametrize("bug", list(PLANTED_BUGS))
def test_planted_bug_fails_the_bar_in_the_reference(bug, planted_bug):
    """The reference reading a checkpoint with a planted bug is far past the bar: the bugs are
    ones the accuracy metric on these models can see."""
    case, folder = planted_bug(bug)
    buggy = teacher_forced_logprobs(ReferenceModel(folder), case.sequences)
    error, clean = mean_abs_delta(buggy, case.original), mean_abs_delta(case.emulation, case.original)  # fmt: skip
    assert error > 2 * BAR * clean, f"{bug}: {error:.4f} against {clean:.4f}"
