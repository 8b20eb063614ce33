"""Structured outputs in the engine, on the CPU: the mask reaches the logits (a grammar that
forbids the greedy token changes the output, one that allows everything does not), padded
vocabularies, asynchronous scheduling, reasoning gating, compile errors, the bitmask kernels."""

from __future__ import annotations

import re

import pytest
import torch
from structured_output_checks import (
    check_allowing_everything_leaves_greedy_outputs_equal,
    check_forbidding_the_greedy_token_changes_the_output,
    full_vocab_model,
    greedy,
    make_llm,
    padded_vocab_model,
)
from tiny_models import build_tiny_model, save_tiny_tokenizer

from kvik.request import Request
from kvik.sampling_params import SamplingParams, StructuredOutputsParams
from kvik.structured_output.bitmask import apply_token_bitmask, unpack_bitmask


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return padded_vocab_model(tmp_path_factory.mktemp("so-padded"))


@pytest.fixture(scope="module")
def padded_llm(padded):
    return make_llm(padded, "cpu", async_scheduling=False)


def test_forbidding_the_greedy_token_changes_the_output(padded_llm):
    check_forbidding_the_greedy_token_changes_the_output(padded_llm)


def test_forbidding_the_greedy_token_with_asynchronous_scheduling(padded):
    llm = make_llm(padded, "cpu", async_scheduling=True)
    assert llm.engine.async_scheduling
    check_forbidding_the_greedy_token_changes_the_output(llm)


def test_allowing_everything_leaves_greedy_outputs_equal(tmp_path):
    check_allowing_everything_leaves_greedy_outputs_equal(
        make_llm(full_vocab_model(tmp_path), "cpu")
    )


def test_sampled_choice_and_json_in_one_batch(padded_llm):
    """Constrained and unconstrained requests share steps; each constrained one follows its own
    grammar (masks are per row), sampled with seeds."""
    llm = padded_llm
    choices = ["alpha", "beta", "gamma"]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(choice=choices),
        )
        for seed in range(4)
    ] + [SamplingParams(temperature=1.0, seed=9, max_tokens=12)]
    params += [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=r"\{\"n\": [0-9]{1,3}\}"),
        )
        for seed in range(3)
    ]
    outs = llm.generate(["Pick:"] * len(params), params, use_tqdm=False)
    for out in outs[:4]:
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    for out in outs[5:]:
        assert re.fullmatch(r"\{\"n\": [0-9]{1,3}\}", out.outputs[0].text)


def test_bad_constraints_are_value_errors_and_the_engine_keeps_running(padded_llm):
    llm = padded_llm
    for bad in (
        StructuredOutputsParams(regex="(unclosed"),
        StructuredOutputsParams(grammar="root ::= missing"),
        StructuredOutputsParams(json={"type": "object", "minProperties": "x"}),
        StructuredOutputsParams(json="{not json"),
    ):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["a"], SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert llm.generate(["a"], greedy(3), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_failing_in_the_core_aborts_only_its_request(padded_llm):
    """Past the front end's check (a request added to the core directly), a grammar that does
    not compile finishes its request as aborted; the others run."""
    core = padded_llm.engine
    bad = Request(
        "bad",
        [5, 6, 7],
        SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(")),
        max_tokens=4,
    )
    good = Request("good", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), max_tokens=4)
    core.add_request(bad)
    core.add_request(good)
    finished = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished == {"bad": "abort", "good": "length"}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_complete_before_min_tokens_stops_the_request(padded, async_scheduling):
    """A grammar that allows only its end (EOS) while min_tokens still forbids EOS left nothing
    to sample: the request took token 0, which the grammar refused, and ended aborted. The
    grammar wins: the output is its complete text, finished "stop", with no foreign token."""
    llm = make_llm(padded, "cpu", async_scheduling=async_scheduling)
    tokenizer = llm.get_tokenizer()
    for spec, text in (({"regex": "ab"}, "ab"), ({"choice": ["yes"]}, "yes")):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            min_tokens=5,
            structured_outputs=StructuredOutputsParams(**spec),
        )
        (out,) = llm.generate(["hello"], params, use_tqdm=False)
        completion = out.outputs[0]
        assert (completion.text, completion.finish_reason) == (text, "stop")
        assert tokenizer.decode(completion.token_ids) == text and 0 not in completion.token_ids
    # Without the conflict nothing changes: min_tokens met first, the grammar ends on EOS.
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="ab")
    )
    (out,) = llm.generate(["hello"], params, use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("ab", "stop")


def test_engine_options_are_checked(padded):
    with pytest.raises(ValueError, match="guidance.*not built"):
        make_llm(padded, "cpu", structured_outputs_backend="guidance")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_llm(padded, "cpu", reasoning_parser="nope")


def test_the_grammar_starts_after_the_reasoning(tmp_path):
    """With a reasoning parser, the grammar constrains only what follows </think>: a prompt that
    closes its reasoning is constrained at once; one still reasoning is free until the model ends
    the reasoning, so greedy output equals the unconstrained one up to that point."""
    build_tiny_model("llama", tmp_path)
    save_tiny_tokenizer(tmp_path, vocab_size=254)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=True)
    tokenizer.save_pretrained(tmp_path)
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert (start, end) == (254, 255)
    llm = make_llm(tmp_path, "cpu", reasoning_parser="qwen3")
    only_digits = StructuredOutputsParams(regex="[0-9]{4}")
    closed = llm.generate(
        [{"prompt_token_ids": [5, 6, start, 7, end]}], greedy(8, only_digits), use_tqdm=False
    )[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", closed.text) and closed.finish_reason == "stop"
    thinking = [5, 6, start, 7]
    free = llm.generate([{"prompt_token_ids": thinking}], greedy(8), use_tqdm=False)[0].outputs[0]
    constrained = llm.generate(
        [{"prompt_token_ids": thinking}], greedy(8, only_digits), use_tqdm=False
    )[0].outputs[0]
    ids = list(free.token_ids)
    same_until = ids.index(end) + 1 if end in ids else len(ids)
    assert list(constrained.token_ids[:same_until]) == ids[:same_until]


def test_bitmask_kernels_agree():
    """xgrammar's CPU kernel (used on the CPU) and the torch path (used on GPUs) mask the same
    ids, for all rows and for some rows, with a vocabulary that is not a multiple of 32."""
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), generator=g).int()
    bits = [(int(bitmask[r, i // 32]) >> (i % 32)) & 1 for r in range(6) for i in range(vocab)]
    expected_allowed = torch.tensor(bits, dtype=torch.bool).view(6, vocab)
    assert torch.equal(unpack_bitmask(bitmask, vocab), expected_allowed)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)
    assert torch.equal(masked, logits.masked_fill(~expected_allowed, float("-inf")))
    rows = [1, 4]
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask[rows], rows)
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~expected_allowed[rows], float("-inf"))
    assert torch.equal(masked, expected)
