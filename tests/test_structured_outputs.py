"""Structured outputs in the engine, on the CPU: the mask reaches the logits (a grammar that
forbids the greedy token changes the output, one that allows everything does not), padded
vocabularies, asynchronous scheduling, reasoning gating, compile errors, the bitmask kernels."""

from __future__ import annotations

import json
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

from kvik.outputs import RequestError
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
        # Keywords xgrammar compiles without enforcing.
        StructuredOutputsParams(json={"not": {"type": "string"}}),
        StructuredOutputsParams(json={"allOf": [{"type": "string"}, {"type": "integer"}]}),
    ):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["a"], SamplingParams(structured_outputs=bad), use_tqdm=False)
    assert llm.generate(["a"], greedy(3), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_failing_in_the_core_fails_only_its_request(padded_llm):
    """Past the front end's check (a request added to the core directly), a grammar that does
    not compile finishes its request with "error", the compiler's message and the field at
    fault (it said "abort", as a request the client left); the others run."""
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
                finished[out.request_id] = out
    assert {id_: out.finish_reason for id_, out in finished.items()} == {
        "bad": "error",
        "good": "length",
    }
    assert finished["bad"].stop_reason.startswith("invalid structured_outputs.regex")
    assert finished["bad"].error_param == "structured_outputs"
    assert finished["good"].error_param is None


#: Constraints that leave no token to sample at the start of the output, the field at fault and
#: the message's start. Sampled, such a request took token 0, which its grammar refused: it ended
#: "abort" with an empty text, the one trace an ERROR line in the log.
_NO_TOKEN_AT_ALL = "the structured output constraint"
DEAD_ENDS = [
    ({"regex": "[^\\x00-\\U0010FFFF]"}, {}, "structured_outputs", _NO_TOKEN_AT_ALL + " (regex)"),
    ({"grammar": "root ::= [\\U00110000]"}, {}, "structured_outputs", _NO_TOKEN_AT_ALL),
    (
        {"choice": ["zz"]},
        {"allowed_token_ids": [5]},
        "allowed_token_ids",
        "allowed_token_ids leave",
    ),
    ({"choice": ["y", "n"]}, {"bad_words": ["y", "n"]}, "bad_words", "bad_words forbid"),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_constraint_that_admits_no_token_is_an_error_naming_why(padded, async_scheduling):
    """Each failing request ends "error" before it samples anything, and the batch raises
    RequestError (a ValueError) naming the first one's prompt, cause and field, once the valid
    requests beside them have run to their end (their outputs ride on the error)."""
    llm = make_llm(padded, "cpu", async_scheduling=async_scheduling)
    for spec, extra, param, message in DEAD_ENDS:
        bad = SamplingParams(
            max_tokens=8, structured_outputs=StructuredOutputsParams(**spec), **extra
        )
        with pytest.raises(RequestError, match=re.escape(f"prompt 1: {message}")) as error:
            llm.generate(["Hello", "Hello"], [greedy(6), bad], use_tqdm=False)
        assert isinstance(error.value, ValueError) and error.value.param == param
        good, failed = (out.outputs[0] for out in error.value.outputs)
        assert (good.finish_reason, len(good.token_ids)) == ("length", 6)
        assert (failed.finish_reason, failed.token_ids, failed.text) == ("error", [], "")
        assert failed.stop_reason.startswith(message)
    # The engine runs on.
    assert len(llm.generate(["Hello"], greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_a_dead_end_after_some_tokens_and_a_complete_grammar(padded_llm):
    """A constraint left with nothing after some tokens fails there, with those tokens and no
    foreign one; a grammar allowing only its end (EOS) where allowed_token_ids forbid EOS has a
    complete output: it stops, as when min_tokens forbids EOS."""
    llm = padded_llm
    ids = llm.get_tokenizer().encode("yes", add_special_tokens=False)
    dead = [
        (StructuredOutputsParams(regex="a[^\\x00-\\U0010FFFF]"), {}, "after 1 output token"),
        (StructuredOutputsParams(choice=["yes"]), {"allowed_token_ids": ids[:2]}, "after 2 output"),
    ]
    for constraint, extra, where in dead:
        params = SamplingParams(max_tokens=8, structured_outputs=constraint, **extra)
        with pytest.raises(RequestError, match=where) as error:
            llm.generate(["Hello"], params, use_tqdm=False)
        (failed,) = error.value.outputs[0].outputs
        assert failed.finish_reason == "error" and 0 not in failed.token_ids
    params = SamplingParams(
        max_tokens=8,
        allowed_token_ids=ids,
        structured_outputs=StructuredOutputsParams(choice=["yes"]),
    )
    (out,) = llm.generate(["Hello"], params, use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("yes", "stop")


def test_stream_raises_for_a_constraint_that_admits_no_token(padded_llm):
    params = SamplingParams(
        max_tokens=8,
        allowed_token_ids=[5],
        structured_outputs=StructuredOutputsParams(choice=["zz"]),
    )
    with pytest.raises(RequestError, match="allowed_token_ids leave no token"):
        list(padded_llm.stream("Hello", params))


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


def test_dead_end_verdicts_on_hand_made_masks():
    """The check before sampling, on mask rows made by hand (vocabulary 64, EOS 2): what is left
    once allowed_token_ids, the bad words the output completes and min_tokens have forbidden
    theirs; the field blamed; "stop" (None) where only EOS was left."""
    import numpy as np

    from kvik.structured_output.manager import _dead_end

    def row(*ids):
        words = np.zeros(2, dtype=np.uint32)
        for i in ids:
            words[i // 32] |= np.uint32(1 << (i % 32))
        return words

    def verdict(allowed_ids, output=(), bad=(), **sp):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), **sp)
        request = Request("r", [1], params, max_tokens=8, eos_token_ids=frozenset({2}))
        request.bad_words_token_ids = [list(w) for w in bad]
        for token in output:
            request.append_output_token(token)
        return _dead_end(request, row(*allowed_ids))

    assert verdict([])[1] == "structured_outputs"
    assert verdict([40]) is None
    assert verdict([40], allowed_token_ids=[41])[1] == "allowed_token_ids"
    assert verdict([40, 41], allowed_token_ids=[41]) is None
    assert verdict([40], bad=[[40]])[1] == "bad_words"
    assert verdict([40], bad=[[7, 40]]) is None  # the word's start is not the output's end
    message, param = verdict([40], output=[7], bad=[[7, 40]])
    assert param == "bad_words" and message.endswith("after 1 output token")
    assert verdict([40, 41], allowed_token_ids=[41], bad=[[41]])[1] == "bad_words"
    assert verdict([2, 40], min_tokens=3, bad=[[40]])[1] == "bad_words"
    assert verdict([2, 33], min_tokens=3, stop_token_ids=[33])[1] == "min_tokens"
    assert verdict([2, 33], min_tokens=3, stop_token_ids=[33], output=[5, 6, 7]) is None
    # Only EOS left, which the others forbid: the output is complete.
    assert verdict([2], min_tokens=3) == (None, None)
    assert verdict([2], allowed_token_ids=[40]) == (None, None)
    assert verdict([2], min_tokens=3, ignore_eos=True) is None


def test_schema_keywords_the_grammar_engine_does_not_enforce_are_found_with_their_place():
    """Each keyword xgrammar 0.2 ignores (its grammar accepted a document breaking it), found in
    subschemas but not in data: a property named "not", enum values, an allOf of one schema."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvik.structured_output.grammar import unenforced_schema_keywords

    ignored = {
        '"x"': {"not": {"type": "string"}},
        "5": {"allOf": [{"type": "string"}, {"type": "integer"}]},
        "1": {"if": {"type": "integer"}, "then": {"minimum": 5}},
        "[1, 1]": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        '{"a": 1}': {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
    }
    for document, schema in ignored.items():
        # Still true of the installed xgrammar? Then kvik must refuse the schema.
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        if accepts(grammar, document):
            assert unenforced_schema_keywords(schema), schema
    nested = {
        "type": "object",
        "properties": {
            "not": {"type": "string", "enum": ["not", "allOf"]},
            "list": {"type": "array", "items": {"anyOf": [{"not": {"const": 1}}]}},
            "one": {"allOf": [{"type": "integer"}]},
        },
        "$defs": {"d": {"uniqueItems": True}},
    }
    assert unenforced_schema_keywords(nested) == [
        "'not' at #/properties/list/items/anyOf/0",
        "'uniqueItems' at #/$defs/d",
    ]
