"""Speculative decoding on the default model in bf16, as users run it: greedy outputs identical
with and without each proposer (n-gram lookup, the model as its own draft, an EAGLE-3 head with
random weights of the model's shapes), also when a stop string ends inside an accepted run.

In bf16 a verification (k + 1 query rows per request through the general attention path) and a
plain decode step (the CPU's one-call decode) must compute each row alike, or rounding would make
greedy outputs depend on whether speculation is on: the random-weight fp32 models of
test_spec_decode_engine.py cannot show that."""

from __future__ import annotations

import re

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.model_loader.default_model import default_model_path
from kvik.spec_decode.eagle3 import Eagle3Config, Eagle3Head, save_eagle3_head

PARAGRAPH = (
    "The river runs past the old mill, under the stone bridge and through the meadow where the "
    "horses graze. In spring the water is high and fast; in late summer it is slow and clear, and "
    "children wade across it to reach the island of willows in the middle."
)
PROMPTS = [
    f"Repeat the following text exactly.\n\n{PARAGRAPH}\n\nRepeated text:\n",
    "Write the numbers from one to twenty in words, separated by commas:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
STOP = "stone bridge"  # inside the repeated paragraph, which the proposers' runs cover
PROPOSERS = ["ngram", "draft_model", "eagle3"]


def engine(speculative_config: dict | None = None) -> LLM:
    # A small KV cache: four engines live together in the test process.
    return LLM(
        dtype="bfloat16",
        max_model_len=1024,
        num_kv_blocks=64,
        speculative_config=speculative_config,
    )


def random_eagle3_head(folder, target: LLM):
    """A head of the target's shapes with random weights (what it proposes does not matter:
    outputs must be the target's), over the first half of the vocabulary."""
    model = target.config.model
    hidden = model.hf_config.hidden_size
    torch.manual_seed(0)
    config = Eagle3Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=model.vocab_size,
        draft_vocab_size=model.vocab_size // 2,
    )
    head = Eagle3Head(config)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.05)
    head.set_vocab_map(torch.arange(model.vocab_size // 2))
    save_eagle3_head(head, folder)
    return folder


@pytest.fixture(scope="module")
def plain() -> LLM:
    return engine()


@pytest.fixture(scope="module")
def speculative(plain, tmp_path_factory):
    """speculative(method) -> an engine with that proposer (made once per module)."""
    made: dict[str, LLM] = {}

    def get(method: str) -> LLM:
        if method not in made:
            config: dict = {"method": method, "num_speculative_tokens": 4}
            if method == "ngram":
                config["prompt_lookup_min"] = 2
            elif method == "draft_model":
                config["model"] = str(default_model_path())
            else:
                config["num_speculative_tokens"] = 3
                config["model"] = str(random_eagle3_head(tmp_path_factory.mktemp("head"), plain))
            made[method] = engine(config)
        return made[method]

    return get


def generate(llm: LLM, params: SamplingParams = GREEDY, prompts=PROMPTS) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", PROPOSERS)
def test_greedy_outputs_identical(method, plain, speculative):
    llm = speculative(method)
    expected, got = generate(plain), generate(llm)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    stats = llm.stats.spec_decoding
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    if method == "ngram":  # the repeated paragraph is proposed for, and mostly accepted
        assert stats.num_accepted_tokens > stats.num_draft_tokens / 2
    if method == "draft_model":  # the model drafting for itself: nearly all accepted
        assert stats.acceptance_rate > 0.9, stats.summary()


@pytest.mark.parametrize("method", PROPOSERS)
def test_stop_string_inside_an_accepted_run(method, plain, speculative):
    llm = speculative(method)
    full = generate(plain, prompts=PROMPTS[:1])[0]
    assert STOP in full.text
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, stop=[STOP])
    expected = generate(plain, params, PROMPTS[:1])[0]
    before = llm.stats.spec_decoding.num_accepted_tokens
    got = generate(llm, params, PROMPTS[:1])[0]
    assert got.text == expected.text == full.text[: full.text.index(STOP)]
    assert got.finish_reason == "stop" and got.stop_reason == STOP
    if method != "eagle3":  # a random head's proposals are rarely accepted
        assert llm.stats.spec_decoding.num_accepted_tokens > before


def test_json_schema_reply_with_ngram(plain, speculative):
    """A grammar under speculation on the model as users run it: drafts cut to what the JSON
    schema allows, a mask at each scored position; the reply equals the plain engine's."""
    from kvik.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }
    prompt = f'Return JSON whose "text" field is this paragraph, copied exactly:\n\n{PARAGRAPH}\n'
    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema)
    )
    llm = speculative("ngram")
    expected = generate(plain, params, [prompt])[0]
    before = llm.stats.spec_decoding.num_accepted_tokens
    got = generate(llm, params, [prompt])[0]
    assert got.token_ids == expected.token_ids
    assert re.match(r'\{\s*"text"\s*:\s*"The river runs', got.text), got.text  # it copies
    assert llm.stats.spec_decoding.num_accepted_tokens > before
