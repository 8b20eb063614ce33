"""Speculative decoding end to end: greedy outputs identical with and without each proposer
(n-gram, a draft model, an EAGLE-3 head with random weights) on random-weight fp32 models, the
acceptance counters a draft model equal to the target must reach (100%), stop strings and stop
tokens inside an accepted run, and the cases that do not speculate (logprobs, penalties)."""

from __future__ import annotations

import pytest
import torch

from kvik import LLM, SamplingParams
from kvik.engine.args import EngineArgs
from kvik.spec_decode.eagle3 import Eagle3Config, Eagle3Head, save_eagle3_head

# Prompts that repeat themselves, so that n-gram lookup finds matches; and one that does not.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    list(range(3, 40)) * 2,
    [11, 17, 23, 4, 99, 200, 13],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def make_llm(folder, speculative_config=None, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(
        str(folder),
        dtype="float32",
        enforce_eager=True,
        block_size=16,
        speculative_config=speculative_config,
        **kwargs,
    )


def generate(llm: LLM, params: SamplingParams = GREEDY, prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy outputs without speculation, per model kind."""
    made = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in made:
            made[kind] = generate(make_llm(tiny_model(kind)))
        return made[kind]

    return get


def random_eagle3_head(folder, target_folder, aux_layers=(0, 1, 1)):
    """A head with random weights for the target's shapes (its quality does not matter: outputs
    must equal the target's whatever it proposes)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target_folder)
    torch.manual_seed(1)
    config = Eagle3Config(
        hidden_size=hf.hidden_size,
        intermediate_size=2 * hf.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=hf.vocab_size,
        draft_vocab_size=hf.vocab_size // 2,
        eagle_aux_hidden_state_layer_ids=list(aux_layers),
    )
    head = Eagle3Head(config)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.2)
    head.set_vocab_map(torch.arange(0, hf.vocab_size, 2))
    save_eagle3_head(head, folder)
    return folder


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral"])
def test_ngram_greedy_outputs_identical(kind, tiny_model, reference):
    llm = make_llm(tiny_model(kind), NGRAM)
    # The tiny qwen3's 30th token of the second prompt is an exact tie between two tokens (in
    # transformers too), which rounding decides either way: compare the 28 before it.
    length = 28 if kind == "qwen3" else GREEDY.max_tokens
    assert [out[:length] for out in generate(llm)] == [out[:length] for out in reference(kind)]
    stats = llm.stats.spec_decoding
    # The repeating prompts are proposed for: an empty proposer would fail here.
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0


def test_draft_model_equal_to_target_is_always_accepted(tiny_model, reference):
    folder = tiny_model("llama")
    config = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    llm = make_llm(folder, config)
    assert generate(llm) == reference("llama")
    stats = llm.stats.spec_decoding
    assert stats.num_drafts >= 3 * 8  # every decode step of every request proposed
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.acceptance_rate == 1.0
    # 40 tokens per request: the first from the prompt step, then 4 per verification.
    assert stats.mean_accepted_length > 3.5


def test_draft_model_other_weights_and_small_budget(tiny_model, reference, tmp_path):
    """A different draft (qwen2 weights, same vocabulary) under a token budget that cuts drafts,
    with few KV blocks (preemptions) and chunked prompts."""
    config = {
        "method": "draft_model",
        "model": str(tiny_model("qwen2")),
        "num_speculative_tokens": 4,
    }
    llm = make_llm(tiny_model("llama"), config, max_num_batched_tokens=8, max_num_seqs=3)
    assert generate(llm) == reference("llama")
    assert llm.stats.spec_decoding.num_drafts > 0


def test_eagle3_random_head_greedy_outputs_identical(tiny_model, reference, tmp_path):
    target = tiny_model("llama")
    head = random_eagle3_head(tmp_path / "head", target)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = make_llm(target, config)
    assert generate(llm) == reference("llama")
    stats = llm.stats.spec_decoding
    # The head proposes k tokens whenever the request may still take them.
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 2 * stats.num_drafts


def test_stop_token_inside_an_accepted_run(tiny_model, reference):
    """A stop token id in the middle of what a draft model (equal to the target) gets accepted:
    the output ends at it, and max_tokens inside a run truncates there too."""
    folder = tiny_model("llama")
    expected = reference("llama")[0]
    stop_at = 9  # well inside a run of 4 tokens per step
    params = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[expected[stop_at]]
    )
    first = expected.index(expected[stop_at])
    config = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    llm = make_llm(folder, config)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == expected[stop_at]
    capped = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    assert generate(llm, capped, PROMPTS[:1]) == [expected[:7]]


def test_stop_string_inside_an_accepted_run(tiny_model, tmp_path):
    """With a tokenizer: a stop string completed by a token inside an accepted run cuts the text
    there and finishes the request, as without speculation."""
    from tiny_models import save_tiny_tokenizer

    folder = tmp_path / "model"
    import shutil

    shutil.copytree(tiny_model("llama"), folder)
    save_tiny_tokenizer(folder)
    plain = make_llm(folder)
    text_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    full = plain.generate([prompt], text_params, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 12
    stop = full.text[8:11]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    config = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 4}
    llm = make_llm(folder, config)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.text == expected.text == full.text[: full.text.index(stop)]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert llm.stats.spec_decoding.num_accepted_tokens > 0


def test_logprobs_and_penalties_speculate(tiny_model):
    """Requests with logprobs or penalties speculate: logprobs come at each accepted position,
    penalties apply at each scored position over the history it follows. Outputs (and logprobs)
    are those of the plain engine, in a batch with others and alone."""
    folder = tiny_model("llama")
    plain = make_llm(folder)
    llm = make_llm(
        folder, {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}
    )
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    penalised = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [with_logprobs, penalised, GREEDY]
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
    for e, g in zip(expected[0].outputs[0].logprobs, got[0].outputs[0].logprobs, strict=True):
        assert e.keys() == g.keys()
        for token_id in e:
            assert g[token_id].logprob == pytest.approx(e[token_id].logprob, abs=1e-5)
    assert [len(g.outputs[0].logprobs) for g in got[:1]] == [12]
    assert llm.stats.spec_decoding.num_drafts > 0

    # Alone, the request with logprobs speculates: a draft equal to the target is always accepted.
    alone = make_llm(
        folder, {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2}
    )
    got = alone.generate(prompts[:1], with_logprobs, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected[0].outputs[0].token_ids
    for e, g in zip(expected[0].outputs[0].logprobs, got.logprobs, strict=True):
        assert e.keys() == g.keys()
        for token_id in e:
            assert g[token_id].logprob == pytest.approx(e[token_id].logprob, abs=1e-5)
            assert g[token_id].rank == e[token_id].rank
    stats = alone.stats.spec_decoding
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens

    # Penalised (repetition, presence and frequency, a minimum length), alone: drafts from the
    # unpenalised target are accepted where the penalties leave its choice alone.
    for params in (
        penalised,
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            min_tokens=10,
            presence_penalty=0.8,
            frequency_penalty=0.6,
            stop_token_ids=[7, 9, 11],
        ),
    ):
        for prompt in prompts:
            plain_out = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            before = alone.stats.spec_decoding.num_drafts
            spec_out = alone.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert spec_out.token_ids == plain_out.token_ids, (params, prompt)
            assert alone.stats.spec_decoding.num_drafts > before


def test_disable_by_batch_size(tiny_model, reference):
    folder = tiny_model("llama")
    llm = make_llm(folder, {**NGRAM, "disable_by_batch_size": 2})
    assert generate(llm) == reference("llama")
    # Three requests run together until the first finishes: nothing proposed while they do.
    both = generate(llm, prompts=PROMPTS[:2])
    assert both == reference("llama")[:2]
    assert llm.stats.spec_decoding.num_drafts > 0


def test_seeded_sampling_is_reproducible(tiny_model):
    folder = tiny_model("llama")
    llm = make_llm(folder, NGRAM)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=7, ignore_eos=True)
    assert generate(llm, params) == generate(llm, params)


def test_seeded_sampling_does_not_depend_on_the_drafts_a_step_gets(tiny_model):
    """A seeded sampled request's tokens are the ones it gets alone, whatever changes how many
    drafts its steps verify: other requests beside it, a token budget that cuts its drafts (and
    chunks prompts), few KV blocks (preemptions), disable_by_batch_size, or no speculation at
    all. Each output position's draws come from (seed, position), and with a proposer's one-hot
    drafts the token at a position is the one the plain sampler takes there."""
    folder = tiny_model("llama")
    # At temperature 0.2 the random-weight model's tokens are likely enough that drafts are
    # accepted now and then; at 1.0 almost never.
    seeded = [
        SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=seed)
        for temperature, seed in ((1.0, 11), (0.2, 12), (0.2, 13))
    ]
    alone_llm = make_llm(folder, NGRAM)
    alone = [generate(alone_llm, params, [p])[0] for params, p in zip(seeded, PROMPTS)]
    assert alone_llm.stats.spec_decoding.num_accepted_tokens > 0
    unseeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    prompts = [PROMPTS[2], *PROMPTS, PROMPTS[1]]
    params = [unseeded, *seeded, GREEDY]

    def together(llm):
        return generate(llm, params, prompts)[1:4]

    budget = make_llm(folder, NGRAM, max_num_batched_tokens=8, max_num_seqs=5)
    assert together(budget) == alone
    assert budget.stats.spec_decoding.num_drafts > 0
    few_blocks = make_llm(folder, NGRAM, num_kv_blocks=10, max_model_len=128)
    assert together(few_blocks) == alone
    assert few_blocks.stats.num_preemptions > 0
    assert together(make_llm(folder, {**NGRAM, "disable_by_batch_size": 3})) == alone
    for async_scheduling in (False, True):
        plain = make_llm(folder, async_scheduling=async_scheduling)
        assert together(plain) == alone


def test_draft_model_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=300,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
    )
    other.save_pretrained(tmp_path / "other")
    config = {
        "method": "draft_model",
        "model": str(tmp_path / "other"),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        make_llm(tiny_model("llama"), config)


def test_more_drafts_than_a_sequence_holds_are_refused(tiny_model):
    """A mistyped num_speculative_tokens (10**7) is a clear error before the runner sizes its
    buffers by it (it took all of a 24 GB machine's memory), and the largest that fits runs."""
    folder = tiny_model("llama")
    too_many = {"method": "ngram", "num_speculative_tokens": 10**7}
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(10000000\) must be smaller"):
        make_llm(folder, too_many, max_model_len=256)
    # The configuration refuses it too, so a server does before its engine process starts.
    args = EngineArgs(model=str(folder), speculative_config=too_many, max_model_len=256)
    with pytest.raises(ValueError, match="must be smaller than max_model_len"):
        args.create_engine_config()
    most = {"method": "ngram", "num_speculative_tokens": 255, "prompt_lookup_min": 1}
    llm = make_llm(folder, most, max_model_len=256)
    assert generate(llm, prompts=PROMPTS[:1]) == generate(make_llm(folder), prompts=PROMPTS[:1])
