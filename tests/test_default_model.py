"""The default model (SmolLM2-135M-Instruct from its GGUF) end to end, against transformers loading
the same GGUF file itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_engine_vs_transformers import assert_greedy_equal

from kvik import LLM, SamplingParams
from kvik.engine.detokenizer import IncrementalDetokenizer
from kvik.model_loader.default_model import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = (
    "You are a careful assistant for a museum of natural history. Visitors ask about fossils, "
    "minerals, animals and the history of the museum. Answer briefly, in plain words, and say so "
    "when you do not know. Never invent opening hours or prices. "
) * 3


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_reference(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    return model.eval()


@pytest.fixture(scope="module")
def llm_fp32():
    # A cache of 40 blocks cannot hold all eight prompts at once: preemption happens.
    return LLM(dtype="float32", max_model_len=600, num_kv_blocks=40, max_num_batched_tokens=128)


def test_greedy_chat_and_plain_prompts_equal_transformers(llm_fp32, hf_reference):
    llm = llm_fp32
    processor = llm.input_processor
    questions = [
        "Which fossils are in the museum?",
        "How old is the oldest mineral?",
        "Tell me about dinosaurs.",
        "What do you know about the museum's history?",
    ]
    chat_prompts = [
        processor.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        )["prompt_token_ids"]
        for q in questions
    ]
    tokenizer = llm.get_tokenizer()
    long_text = " ".join(
        f"Paragraph {i}: the river flows past the old mill and the bridge." for i in range(28)
    )
    plain = [
        tokenizer.encode(t)
        for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time", long_text)
    ]
    assert len(plain[-1]) > 400
    prompts = chat_prompts + plain
    llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # cache the prefix
    before = llm.stats
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats
    assert after.prefix_cache_hits > before.prefix_cache_hits
    assert after.num_preemptions > before.num_preemptions
    assert after.num_prefill_chunks > before.num_prefill_chunks
    assert_greedy_equal(prompts, outputs, hf_reference, 16)


def test_capital_of_france_in_default_dtype():
    llm = LLM(max_model_len=512)
    (out,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_kvik_generate_and_chat_commands():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kvik = [sys.executable, "-m", "kvik"]
    generated = subprocess.run(
        [
            *kvik,
            "generate",
            "What is the capital of France?",
            "--max-model-len",
            "512",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert generated.returncode == 0, generated.stderr
    assert "Paris" in generated.stdout
    chat = subprocess.run(
        [*kvik, "chat", "--max-model-len", "512", "--max-tokens", "24"],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout


def test_stop_string_spanning_two_tokens(llm_fp32):
    llm = llm_fp32
    params = SamplingParams(temperature=0, max_tokens=24)
    (free,) = llm.chat(QUESTION, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    ids = free.outputs[0].token_ids
    # A stop string made of the last character of one token and the first of the next.
    first = tokenizer.decode(ids[:3])
    second = tokenizer.decode(ids[:4])
    assert len(second) > len(first) > 0
    stop = first[-1] + second[len(first)]
    expected = free.outputs[0].text[: free.outputs[0].text.index(stop)]
    stop_params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    (stopped,) = llm.chat(QUESTION, stop_params, use_tqdm=False)
    assert stopped.outputs[0].text == expected
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop
    included = SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
    )
    (with_stop,) = llm.chat(QUESTION, included, use_tqdm=False)
    assert with_stop.outputs[0].text == expected + stop
    # Streaming never shows the part of a stop string it later takes back.
    prompt = llm.input_processor.apply_chat_template(QUESTION)
    assert "".join(llm.stream(prompt, stop_params)) == expected


def test_multibyte_characters_stream_whole(llm_fp32):
    tokenizer = llm_fp32.get_tokenizer()
    text = "Crème brûlée, 日本語, and 🎉🦖 emoji."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the text should split characters across tokens"
    detokenizer = IncrementalDetokenizer(
        tokenizer, tokenizer.encode("Say:"), skip_special_tokens=True
    )
    chunks = [detokenizer.step(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks).strip() == text


def test_export_loads_in_transformers_with_the_same_logits(tmp_path, hf_reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvik.cli.export import export_model

    out = export_model(None, tmp_path / "smollm2")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        a = exported(ids).logits
        b = hf_reference(ids).logits
    assert (a - b).abs().max() / b.abs().max() < 1e-5
    assert tokenizer.chat_template is not None
