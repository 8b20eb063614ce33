"""Speculative decoding with structured outputs, on the CPU: drafts are cut to what the grammar
accepts and every scored position gets its own mask, so greedy outputs equal the plain engine's,
drafts are still accepted, and sampled outputs follow their grammars."""

from __future__ import annotations

import json
import re

import pytest
from structured_output_checks import padded_vocab_model

from kvik import LLM, SamplingParams
from kvik.sampling_params import StructuredOutputsParams

PROMPTS = ["Hello world", "The cat", "1, 2, 3,", "abc", "xyz", "Once upon"]
# Not [ -~]: xgrammar 0.2.9 lets that class end after 8 of {12,30} characters.
PRINTABLE = r"[a-zA-Z0-9 ,.]{12,30}"
REPEATING = r"(ab|cd|e){4,20}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return padded_vocab_model(tmp_path_factory.mktemp("spec-so"))


def make_llm(folder, speculative_config=None) -> LLM:
    return LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        num_kv_blocks=128,
        speculative_config=speculative_config,
    )


def constrained(structured: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=48, structured_outputs=structured, **kw)


def grammars() -> list[StructuredOutputsParams]:
    return [
        StructuredOutputsParams(regex=PRINTABLE),
        StructuredOutputsParams(regex=REPEATING),
        StructuredOutputsParams(json=SCHEMA),
    ]


@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model)


@pytest.mark.parametrize(
    "config",
    [
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ],
    ids=["draft_model", "ngram"],
)
def test_greedy_outputs_identical_with_grammars(model, plain, config):
    if config["method"] == "draft_model":
        config = {**config, "model": str(model)}  # drafts: the target's unconstrained argmax
    llm = make_llm(model, config)
    prompts = [p for p in PROMPTS for _ in grammars()]
    params = [constrained(g) for _ in PROMPTS for g in grammars()]
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, g.prompt
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
    stats = llm.stats.spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    check_grammars_followed(got, params)


def check_grammars_followed(outputs, params) -> None:
    """Outputs that ended with their grammar match it whole; at least some did."""
    num_ended = 0
    for out, p in zip(outputs, params, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length"), completion
        if completion.finish_reason == "length":
            continue
        num_ended += 1
        grammar = p.structured_outputs
        if grammar.regex is not None:
            assert re.fullmatch(grammar.regex, completion.text), (grammar.regex, completion.text)
        else:
            assert set(json.loads(completion.text)) == {"name", "n"}
    assert num_ended >= len(outputs) // 3


def test_sampled_outputs_follow_their_grammars(model):
    """Sampled drafts from the unconstrained draft model, verified by the rejection sampler on
    masked rows: every token of every output (bonus tokens included) follows the grammar."""
    llm = make_llm(
        model, {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    )
    prompts = [p for p in PROMPTS for _ in grammars()]
    params = [
        constrained(g, temperature=1.0, seed=i)
        for i, g in enumerate(g for _ in PROMPTS for g in grammars())
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    check_grammars_followed(outputs, params)
    assert llm.stats.spec_decoding.num_accepted_tokens > 0


def test_drafts_cut_to_the_grammar_and_one_mask_per_scored_position(model, plain):
    """The manager cuts drafts at the first one the grammar refuses (leaving the matcher where it
    was), and a step that scores k drafts gets k + 1 masks: before each draft and after the last."""
    from kvik.request import Request
    from kvik.scheduler.output import ScheduledRequest
    from kvik.structured_output.bitmask import unpack_bitmask

    manager = plain.engine.structured_outputs
    tokenizer = plain.get_tokenizer()
    ids = tokenizer.encode("abcd", add_special_tokens=False)
    assert len(ids) == 4
    params = constrained(StructuredOutputsParams(regex="abcd"))
    request = Request("r", [5, 6, 7], params, max_tokens=8, eos_token_ids={2})
    manager.add_request(request)
    request.structured_output.compiled.result(timeout=60)
    assert manager.is_ready(request)
    z = tokenizer.encode("z", add_special_tokens=False)
    assert manager.valid_drafts(request, ids[:2] + z + ids[3:]) == ids[:2]
    assert manager.valid_drafts(request, ids + [2, ids[0]]) == ids + [2]  # nothing after the end
    scheduled = ScheduledRequest(request, 3, 3, [0], True, spec_token_ids=tuple(ids[:2]))
    grammar = manager.grammar_bitmask([scheduled])
    assert grammar.request_ids == ["r"] and grammar.row_counts() == [3]
    allowed = unpack_bitmask(grammar.bitmask, 256)
    for row, token in enumerate(ids[:3]):
        assert allowed[row].nonzero().flatten().tolist() == [token]
    # The matcher is back where it was: the first position still allows only "a".
    again = manager.grammar_bitmask([ScheduledRequest(request, 3, 1, [0], True)])
    assert unpack_bitmask(again.bitmask, 256)[0].nonzero().flatten().tolist() == [ids[0]]
