"""kvik on FP8 checkpoints of every format, against the unquantized original and an independent
reference of the format (fp8_reference.independent_reference: transformers' own loader for
compressed-tensors, a float64 emulation for fine-grained FP8 and ModelOpt), in fp32 activations
on the CPU.

The bar (issue 14): kvik's teacher-forced mean |delta logprob| against the original is at most
1.5x the reference's. Equality is not the bar: two exact implementations that round a few
activations the other way (x / s against x * (1 / s), fp32 against float64 scales) already
differ per token by a good part of what FP8 itself costs, since every rounding flip moves all
later layers. Greedy generations agree but at near-ties: where kvik's token is, by the
reference's logprobs, within twice the format's largest rounding error (Fp8Case
.near_tie_tolerance) of the reference's own choice. A checkpoint with a planted bug (block scales
transposed, shard scales swapped) read by kvik must land past the bar."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import FORMATS, PLANTED_BUGS
from fp8_reference import BAR, GREEDY_PROMPTS, GREEDY_TOKENS, greedy_disagreement, mean_abs_delta

from kvik import LLM, SamplingParams

FORMAT_NAMES = list(FORMATS)


def kvik_llm(folder) -> LLM:
    return LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        enforce_eager=True,
        num_kv_blocks=64,
        max_model_len=256,
    )


def kvik_logprobs(llm: LLM, sequences: torch.Tensor) -> torch.Tensor:
    """kvik's teacher-forced logprobs of each sequence's tokens: [n, length - 1]."""
    prompts = [{"prompt_token_ids": s.tolist()} for s in sequences]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)  # fmt: skip
    rows = []
    for seq, out in zip(sequences.tolist(), outputs):
        rows.append([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], seq[1:])])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.fixture(scope="module")
def kvik_on(fp8_case):
    """kvik_on(name) -> the kvik LLM on format ``name``'s checkpoint, one per module."""
    made: dict[str, LLM] = {}

    def get(name: str) -> LLM:
        if name not in made:
            made[name] = kvik_llm(fp8_case(name).folder)
        return made[name]

    return get


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_logprob_error_within_the_bar(name, fp8_case, kvik_on):
    case = fp8_case(name)
    got = kvik_logprobs(kvik_on(name), case.sequences)
    error = mean_abs_delta(got, case.original)
    report = (
        f"{name}: kvik's mean |delta logprob| against the original {error:.4f}, the reference's "
        f"{case.reference_error:.4f} (bar {BAR}x); kvik against the reference "
        f"{mean_abs_delta(got, case.reference):.4f}"
    )
    print(report)
    assert error <= BAR * case.reference_error, report


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_greedy_agrees_but_at_near_ties(name, fp8_case, kvik_on):
    case = fp8_case(name)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outputs = kvik_on(name).generate(GREEDY_PROMPTS, params, use_tqdm=False)
    problems = []
    for prompt, expected, out in zip(GREEDY_PROMPTS, case.reference_greedy(), outputs):
        problem = greedy_disagreement(
            case.reference_model, prompt, expected, list(out.outputs[0].token_ids),
            case.near_tie_tolerance,
        )  # fmt: skip
        if problem:
            problems.append(f"prompt of {len(prompt)} tokens: {problem}")
    assert not problems, f"{name}: " + "; ".join(problems)


@pytest.mark.parametrize("bug", list(PLANTED_BUGS))
def test_planted_bug_fails_the_bar(bug, planted_bug):
    """kvik reading a checkpoint with a planted bug computes what a kvik with that bug in its
    loader would; the accuracy bar must catch it."""
    case, folder = planted_bug(bug)
    got = kvik_logprobs(kvik_llm(folder), case.sequences)
    error = mean_abs_delta(got, case.original)
    assert error > BAR * case.reference_error, (
        f"{bug}: kvik's error {error:.4f} is within the bar of the reference's {case.reference_error:.4f}"  # fmt: skip
    )
