"""Structured-output checks on a tiny random-weight model, run on the CPU
(tests/test_structured_outputs.py) and on a GPU (tests/test_gpu_structured_outputs.py): the mask
must really reach the logits on each device."""

from __future__ import annotations

import re
from pathlib import Path

from tiny_models import build_tiny_model, save_tiny_tokenizer

from kvik import LLM, SamplingParams
from kvik.sampling_params import StructuredOutputsParams

PROMPTS = ["Hello world", "The cat", "1, 2, 3,", "abc", "xyz", "Once upon"]
MODEL_VOCAB = 256
#: The tokenizer knows fewer ids than the model's logits have: ids 200..255 are padding.
TOKENIZER_VOCAB = 200
# The tiny tokenizer's ids 3..98 are the printable ASCII characters and the newline.
PRINTABLE_IDS = range(3, 99)


def padded_vocab_model(folder: Path) -> Path:
    build_tiny_model("llama", folder)
    return save_tiny_tokenizer(folder, vocab_size=TOKENIZER_VOCAB)


def full_vocab_model(folder: Path) -> Path:
    build_tiny_model("llama", folder)
    return save_tiny_tokenizer(folder, vocab_size=MODEL_VOCAB)


def make_llm(folder: Path, device: str, **options) -> LLM:
    return LLM(str(folder), device=device, max_model_len=128, num_kv_blocks=64, **options)


def greedy(max_tokens: int, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)


def check_forbidding_the_greedy_token_changes_the_output(llm: LLM) -> None:
    """Take a prompt whose unconstrained greedy first token is a printable character; a grammar
    that forbids that character must change the first token, and the output must follow it."""
    free = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    candidates = [
        (prompt, out.outputs[0].token_ids[0])
        for prompt, out in zip(PROMPTS, free)
        if out.outputs[0].token_ids[0] in PRINTABLE_IDS
    ]
    assert candidates, "no prompt starts with a printable greedy token"
    tokenizer = llm.get_tokenizer()
    for prompt, first in candidates[:3]:
        char = tokenizer.decode([first])
        pattern = f"[^{re.escape(char)}\\n]{{6}}"
        out = llm.generate(
            [prompt], greedy(10, StructuredOutputsParams(regex=pattern)), use_tqdm=False
        )[0].outputs[0]
        assert out.token_ids[0] != first
        assert re.fullmatch(pattern, out.text), (pattern, out.text)
        assert out.finish_reason == "stop"  # the grammar ended, so only EOS was allowed
        assert all(t < TOKENIZER_VOCAB for t in out.token_ids)  # padding ids masked


def check_allowing_everything_leaves_greedy_outputs_equal(llm: LLM) -> None:
    """A grammar that accepts any text masks nothing a text can hold: greedy outputs are the
    unconstrained ones, token for token (prompts whose unconstrained output samples a special
    token, which no grammar allows, are left out)."""
    free = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    kept = [
        (prompt, out.outputs[0].token_ids)
        for prompt, out in zip(PROMPTS, free)
        if all(t == 2 or t >= 3 for t in out.outputs[0].token_ids)  # 0, 1: <unk>, <s>
    ]
    assert len(kept) >= 2
    anything = StructuredOutputsParams(regex=r"[\s\S]*")
    outs = llm.generate([p for p, _ in kept], greedy(12, anything), use_tqdm=False)
    for (prompt, free_ids), out in zip(kept, outs):
        assert list(out.outputs[0].token_ids) == list(free_ids), prompt
