"""The default model (SmolLM2-135M-Instruct from its GGUF) end to end, against transformers loading
the same GGUF file itself; its bf16 fidelity and the README's examples on every CPU kernel path
this CPU runs (tests/cpu_paths.py)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from contextlib import contextmanager

import cpu_paths
import pytest
import torch
from test_engine_vs_transformers import assert_greedy_equal

from kvik import LLM, SamplingParams
from kvik.engine.detokenizer import IncrementalDetokenizer
from kvik.model_loader.default_model import default_model_path
from kvik_cpu.isa import CpuIsa

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = (
    "You are a careful assistant for a museum of natural history. Visitors ask about fossils, "
    "minerals, animals and the history of the museum. Answer briefly, in plain words, and say so "
    "when you do not know. Never invent opening hours or prices. "
) * 3

cpu_path = cpu_paths.cpu_path  # the fixture: each CPU kernel path this CPU runs


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
def hf_bf16(hf_reference):
    # The same as loading the GGUF with dtype=torch.bfloat16 (both round the dequantised float32
    # weights to nearest), without dequantising it a second time.
    return copy.deepcopy(hf_reference).to(torch.bfloat16)


@pytest.fixture(scope="module")
def llm_fp32():
    # A cache of 40 blocks cannot hold all eight prompts at once: preemption happens.
    return LLM(
        dtype="float32",
        max_model_len=600,
        num_kv_blocks=40,
        max_num_batched_tokens=128,
        enforce_eager=True,
    )


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


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def first_divergence(hf_model, prompt: list[int], got: list[int]) -> tuple[int, torch.Tensor]:
    """Where kvik's greedy tokens first leave transformers' greedy continuation, and transformers'
    logits there (len(got) and the last position's logits when they never do).

    One teacher-forced forward over the prompt and kvik's tokens: by causality, the logits at
    each output position are those of transformers on the prompt and kvik's tokens before it, so
    the first position whose argmax is not kvik's token is the first position where transformers'
    greedy decoding (without a KV cache) picks another token, and its logits there are
    transformers' on the prompt plus the common prefix."""
    with torch.no_grad(), torch_threads(1):  # the reference's speed only: steady on a busy CPU
        ids = torch.tensor([prompt + got], device=hf_model.device)
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
    differs = (logits.argmax(-1) != torch.tensor(got, device=logits.device)).nonzero()
    i = int(differs[0]) if len(differs) else len(got)
    return i, logits[min(i, len(got) - 1)]


def test_bfloat16_agrees_with_transformers_in_bfloat16(hf_bf16, cpu_path):
    """kvik in bfloat16, on each CPU kernel path, against transformers in bfloat16: greedy outputs
    may part only where kvik's token is among transformers' top 5 at the first differing
    position, and at least half of the prompts agree on their first 8 tokens."""
    llm = LLM(device="cpu", dtype="bfloat16", max_model_len=1024, num_kv_blocks=256)
    processor = llm.input_processor
    conversations = [
        QUESTION,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which fossils?"}],
        [{"role": "user", "content": "Write a haiku about autumn."}],
    ]
    chat = [processor.apply_chat_template(c)["prompt_token_ids"] for c in conversations]
    tokenizer = llm.get_tokenizer()
    long_text = " ".join(
        f"Paragraph {i}: the river flows past the old mill and the bridge." for i in range(14)
    )
    plain = [
        tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", long_text)
    ]
    prompts = chat + plain
    assert len(prompts[1]) > 100 and len(prompts[-1]) > 200
    max_tokens = 32
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)  # one batch
    report, failures, agree_8 = [], [], 0
    for prompt, output in zip(prompts, outputs):
        got = list(output.outputs[0].token_ids)
        assert len(got) == max_tokens
        i, logits = first_divergence(hf_bf16, prompt, got)
        agree_8 += i >= 8
        if i == len(got):
            report.append(f"prompt of {len(prompt)} tokens: equal for all {max_tokens}")
            continue
        rank = int((logits > logits[got[i]]).sum())
        gap = float(logits.log_softmax(-1).max() - logits.log_softmax(-1)[got[i]])
        line = (
            f"prompt of {len(prompt)} tokens: first differs at output {i}: kvik {got[i]} "
            f"(rank {rank} in transformers, logprob {gap:.3f} below its best), "
            f"transformers {int(logits.argmax())}"
        )
        report.append(line)
        if rank >= 5:  # not in transformers' top 5 (a token tied with the fifth counts as in)
            failures.append(line)
    print("\n".join(report))
    assert not failures, "\n".join(report)
    assert agree_8 >= len(prompts) / 2, "\n".join(report)


#: A conversation the default model is at home in, teacher-forced through each path: a reply
#: written for it (not the model's own), so that every position's token is a real test.
FIDELITY_TEXT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {
        "role": "assistant",
        "content": "The capital of France is Paris. It lies on the Seine, in the north of the "
        "country, and has been the seat of the French government for most of the last thousand "
        "years. Paris is known for the Eiffel Tower, the Louvre, which holds the Mona Lisa, and "
        "the cathedral of Notre-Dame. About two million people live in the city itself and more "
        "than twelve million in its metropolitan area.",
    },
    {
        "role": "user",
        "content": "Write a short Python function that returns the larger of two numbers.",
    },
    {
        "role": "assistant",
        "content": "Here is one:\n\n```python\ndef larger(a, b):\n    return a if a >= b else b\n```"
        "\n\nIt compares the two numbers and returns the first when it is at least as large as "
        "the second, otherwise the second.",
    },
    {"role": "user", "content": "How do plants make their food?"},
    {
        "role": "assistant",
        "content": "Plants make their food by photosynthesis. Their leaves take in carbon dioxide "
        "from the air through small pores, and their roots draw up water from the soil. Inside "
        "the leaf cells, chlorophyll captures the energy of sunlight and uses it to turn the "
        "water and carbon dioxide into glucose, a sugar the plant burns for energy or stores as "
        "starch. Oxygen is released as a by-product, which is why forests and oceans full of "
        "algae matter so much for the air we breathe. Without light, photosynthesis stops, so "
        "most plants grow towards the sun.",
    },
]


@pytest.fixture(scope="module")
def fidelity_ids(gguf_path):
    from kvik.engine.input_processor import InputProcessor
    from kvik.model_loader.loader import load_model_config

    processor = InputProcessor(load_model_config(str(gguf_path), dtype="float32"))
    ids = processor.apply_chat_template(FIDELITY_TEXT, add_generation_prompt=False)
    return ids["prompt_token_ids"]


def teacher_forced_logprobs_hf(model, ids: list[int]) -> torch.Tensor:
    """log p(token t | tokens before t) for t = 1.., from one forward pass of transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="module")
def fidelity_reference(hf_reference, hf_bf16, fidelity_ids):
    """The fp32 logprobs of the text, and transformers' bf16 |delta logprob| at each token."""
    fp32 = teacher_forced_logprobs_hf(hf_reference, fidelity_ids)
    return fp32, (teacher_forced_logprobs_hf(hf_bf16, fidelity_ids) - fp32).abs()


@pytest.mark.parametrize("steps", ["prompt", "decode"])
def test_bf16_fidelity_is_at_least_transformers(cpu_path, steps, fidelity_ids, fidelity_reference):
    """Each path in bf16, teacher-forced through a fixed text: its mean |delta logprob| against the
    fp32 reference is at most transformers' bf16 error on the same text, within the comparison's
    own noise. ``prompt``: the text as one prompt (prompt attention, the matmuls on many rows);
    ``decode``: one token a step (a token budget of 1), so that every position runs the decode
    kernels (paged attention, on AMX the one-call decode loop) as generation does.

    The margin is two standard errors of the mean of the per-token differences (kvik's |delta|
    minus transformers'), computed from the tokens themselves. Two equally exact bf16
    implementations land on either side of each other token by token, and their means differ by
    noise of about that size: transformers' own sdpa and eager attention do, and so do the paged
    decode kernel (which rounds each output exactly once) and SDPA, each ahead on about half the
    tokens. A path worse by more than that noise, as a kernel that rounds wrongly is, fails."""
    fp32, transformers_errors = fidelity_reference
    llm = LLM(
        dtype="bfloat16",
        max_model_len=512,
        num_kv_blocks=48,
        max_num_batched_tokens=1 if steps == "decode" else None,
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": fidelity_ids}], params, use_tqdm=False)
    got = torch.tensor(
        [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], fidelity_ids[1:])]
    )
    errors = (got - fp32).abs()
    excess = errors - transformers_errors
    margin = 2 * float(excess.std()) / len(excess) ** 0.5
    report = (
        f"kvik's bf16 on the {cpu_path.label} path ({steps}), {len(errors)} tokens: mean |delta "
        f"logprob| against fp32 {float(errors.mean()):.4f}, transformers' bf16 "
        f"{float(transformers_errors.mean()):.4f}, margin (2 standard errors) {margin:.4f}"
    )
    print(report)
    assert float(excess.mean()) <= margin, report


def test_readme_llm_chat_example_answers_paris(cpu_path):
    """README.md's Python example, as written, on each kernel path in its default dtype (bf16, or
    float32 on the plain path)."""
    llm = LLM()  # the default model; LLM("path/to/folder-or.gguf") for others
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert llm.config.model.dtype == (torch.float32 if cpu_path is CpuIsa.PLAIN else torch.bfloat16)
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_readme_generate_command_answers_paris(cpu_path):
    """README.md's ``kvik generate "What is the capital of France?"``, as written, in a process
    started with the path forced (so oneDNN is capped as on a CPU without the path's features)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVIK_CPU_ISA": cpu_path.label}
    generated = subprocess.run(
        [sys.executable, "-m", "kvik", "generate", "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert generated.returncode == 0, generated.stderr
    assert "Paris" in generated.stdout, generated.stdout


def test_kvik_chat_command():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kvik = [sys.executable, "-m", "kvik"]
    chat = subprocess.run(
        [*kvik, "chat", "--max-model-len", "512", "--max-tokens", "24", "--enforce-eager"],
        # A line that is not UTF-8 first: refused alone, and the chat goes on; then a line that
        # takes the conversation past max_model_len: refused, with the way out (/reset).
        input=b"\xff\xfe\nWhat is the capital of France?\n" + b"word " * 600 + b"\n",
        capture_output=True,
        timeout=300,
        env=env,
    )
    stdout, stderr = chat.stdout.decode(), chat.stderr.decode()
    assert chat.returncode == 0, stderr
    assert "kvik chat: text must be valid Unicode" in stderr
    assert "Paris" in stdout
    assert "max_model_len is 512" in stderr and "/reset starts a new one" in stderr


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
