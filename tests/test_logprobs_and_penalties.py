"""Logprobs, prompt logprobs and the logits processors, against transformers on the same weights."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import load_hf, ragged_prompts

from kvik import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm_and_hf(tiny_model):
    folder = tiny_model("llama")
    return LLM(
        str(folder),
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=24,
        enforce_eager=True,
    ), load_hf(folder)


def test_logprobs_equal_log_softmax_of_transformers(llm_and_hf):
    llm, hf = llm_and_hf
    prompts = ragged_prompts(3, seed=11, low=8, high=40)
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        tokens = prompt + completion.token_ids
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        # Prompt logprobs: position p's distribution scores prompt token p + 1.
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            assert prompt[p] in entry
            assert abs(entry[prompt[p]].logprob - float(expected[p - 1, prompt[p]])) <= 1e-4
            top = expected[p - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry)
        # Sample logprobs: the sampled token plus the top 5, with ranks.
        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = expected[len(prompt) - 1 + i]
            assert abs(entry[token].logprob - float(row[token])) <= 1e-4
            assert entry[token].rank == 1  # greedy picks the best
            for tid, lp in entry.items():
                assert abs(lp.logprob - float(row[tid])) <= 1e-4
            total += entry[token].logprob
        assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-6)


def test_prompt_logprobs_bypass_the_prefix_cache(llm_and_hf):
    llm, _ = llm_and_hf
    prompt = ragged_prompts(1, seed=12, low=50, high=51)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_repetition_penalty_matches_transformers(llm_and_hf):
    llm, hf = llm_and_hf
    prompts = ragged_prompts(3, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.7)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, repetition_penalty=1.7
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected


def test_logit_bias_allowed_tokens_and_penalties(llm_and_hf):
    llm, _ = llm_and_hf
    prompt = ragged_prompts(1, seed=14)[0]
    biased = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={77: 100.0}),
        use_tqdm=False,
    )
    assert biased[0].outputs[0].token_ids == [77] * 5
    allowed = llm.generate(
        [prompt],
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, allowed_token_ids=[5, 9, 11]
        ),
        use_tqdm=False,
    )
    assert set(allowed[0].outputs[0].token_ids) <= {5, 9, 11}
    # A large frequency penalty forbids repeats in greedy decoding.
    free = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    penalised = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0,
            max_tokens=30,
            ignore_eos=True,
            frequency_penalty=2.0,
            presence_penalty=2.0,
        ),
        use_tqdm=False,
    )
    tokens = penalised[0].outputs[0].token_ids
    assert len(set(tokens)) > len(set(free[0].outputs[0].token_ids)) or len(set(tokens)) == len(
        tokens
    )


def test_bad_token_ids_out_of_vocab_are_refused(llm_and_hf):
    llm, _ = llm_and_hf
    for params in (
        SamplingParams(stop_token_ids=[1000]),
        SamplingParams(allowed_token_ids=[1000]),
        SamplingParams(logit_bias={1000: 1.0}),
    ):
        with pytest.raises(ValueError, match="1000|vocab"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)


def test_logprobs_beyond_max_logprobs_are_refused(llm_and_hf, tiny_model):
    """vLLM's max_logprobs (default 20): more logprobs a position, or the whole vocabulary (-1),
    is an error unless the engine lifts the limit; within it they come back."""
    llm, _ = llm_and_hf
    for params in (
        SamplingParams(logprobs=21),
        SamplingParams(prompt_logprobs=-1),
        SamplingParams(max_tokens=1, prompt_logprobs=10**6),
    ):
        with pytest.raises(ValueError, match="more than max_logprobs=20"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)
    assert all(len(entry) >= 20 for entry in out.outputs[0].logprobs)
    unlimited = LLM(
        str(tiny_model("llama")), dtype="float32", num_kv_blocks=64, enforce_eager=True,
        max_logprobs=-1,
    )  # fmt: skip
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    (out,) = unlimited.generate([[5, 6, 7]], params, use_tqdm=False)
    vocab = unlimited.config.model.vocab_size
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="max_logprobs must be >= -1"):
        LLM(str(tiny_model("llama")), max_logprobs=-2)


def test_priorities_and_seeds_at_the_int64_edges(llm_and_hf, tiny_model):
    """Priorities and seeds cross to the engine core as 64-bit signed integers: one past them is
    refused before any prompt is added, and the edges work (child seeds of n > 1 wrap). A
    priority needs priority scheduling (as vLLM: under fcfs it was silently ignored)."""
    llm, _ = llm_and_hf
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="priority must be in"):
        llm.generate([[5, 6], [7, 8]], params, priority=[0, 2**63], use_tqdm=False)
    with pytest.raises(ValueError, match="priority 3 needs an LLM made with scheduling_policy="):
        llm.generate([[5, 6], [7, 8]], params, priority=[0, 3], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.generate([[5, 6]], params, priority=[0], use_tqdm=False)  # 0 is every request's default
    by_priority = LLM(
        str(tiny_model("llama")), dtype="float32", num_kv_blocks=64, enforce_eager=True,
        scheduling_policy="priority",
    )  # fmt: skip
    edge = SamplingParams(max_tokens=2, temperature=1.0, seed=2**63 - 1, n=2)
    (out,) = by_priority.generate([[5, 6]], edge, priority=[-(2**63)], use_tqdm=False)
    assert [len(o.token_ids) for o in out.outputs] == [2, 2]


def test_the_offline_api_names_what_it_was_given(llm_and_hf):
    llm, _ = llm_and_hf
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="or a list of them, got NoneType"):
        llm.generate(None, params, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams .* got dict"):
        llm.generate([[5, 6]], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([[5, 6], [7]], [params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="priority must be a list of ints, one a prompt, got int"):
        llm.generate([[5, 6]], params, priority=3, use_tqdm=False)
    with pytest.raises(ValueError, match="got bytes"):
        llm.generate(b"hi", params, use_tqdm=False)  # not the token ids [104, 105]
    with pytest.raises(ValueError, match="'prompt_token_ids' must be a list of ints, got NoneType"):
        llm.generate({"prompt_token_ids": None}, params, use_tqdm=False)
    for prompt, message in (  # ignored, or run as token ids, before
        ({"prompt_token_ids": [5, 6], "multi_modal_data": {}}, r"\['multi_modal_data'\] are not"),
        ({"prompt": [5, 6]}, "'prompt' must be a string, got list"),
        ({"prompt": 5, "prompt_token_ids": [5, 6]}, "'prompt' must be a string, got int"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="messages must be a conversation .* got dict"):
        llm.chat({"role": "user", "content": "hi"}, params, use_tqdm=False)  # was KeyError: 0
    changed = SamplingParams(max_tokens=2)
    changed.top_p = 5.0  # set after construction: checked again, not sampled with
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 5.0"):
        llm.generate([[5, 6], [7, 8]], [params, changed], use_tqdm=False)
    hi = [{"role": "user", "content": "hi"}]
    for kwargs, message in (  # TypeErrors from transformers and jinja2 before
        ({"chat_template_kwargs": 5}, "chat_template_kwargs must be a dict, got int"),
        ({"chat_template": 5}, "chat_template must be a string"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt must be a bool"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),  # jinja2's TypeError
    ):
        with pytest.raises(ValueError, match=message):
            llm.chat(hi, params, use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_top_k_beyond_the_vocabulary_is_off(llm_and_hf):
    """A top_k past the vocabulary keeps every token (it overflowed the sampler's int32 row, and
    the request then failed every later step of the engine)."""
    llm, _ = llm_and_hf
    seeded = dict(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    (off,) = llm.generate([[5, 6, 7]], SamplingParams(**seeded), use_tqdm=False)
    for top_k in (llm.config.model.vocab_size, 2**40):
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(**seeded, top_k=top_k), use_tqdm=False)
        assert out.outputs[0].token_ids == off.outputs[0].token_ids


def test_an_allow_list_with_nothing_left_to_sample_is_refused(llm_and_hf):
    """allowed_token_ids holding only EOS (2) or stop tokens, which min_tokens forbids: every
    logit was -inf and the sampler returned token 0, outside the list."""
    llm, _ = llm_and_hf
    for params in (
        SamplingParams(allowed_token_ids=[2], min_tokens=2),
        SamplingParams(allowed_token_ids=[9, 2], stop_token_ids=[9], min_tokens=1),
    ):
        with pytest.raises(ValueError, match="allowed_token_ids .* are all forbidden"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    # With EOS ignored, or some token left, it samples within the list.
    for params in (
        SamplingParams(allowed_token_ids=[2], min_tokens=2, ignore_eos=True, max_tokens=3),
        SamplingParams(allowed_token_ids=[2, 9], min_tokens=2, temperature=1.0, max_tokens=3),
    ):
        (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert set(out.outputs[0].token_ids) <= set(params.allowed_token_ids)


@pytest.mark.parametrize(
    "extreme",
    [
        dict(temperature=1e39),  # float32's inf: a masked logit divided by it was NaN
        dict(repetition_penalty=1e-300),  # float32's 0: -inf * 0 was NaN
        dict(repetition_penalty=1e-40, temperature=1.0),  # finite logits / 1e-40 were inf
        dict(repetition_penalty=1e300, temperature=1.0),
    ],
)
def test_extreme_temperature_and_penalty_sample_within_the_allow_list(llm_and_hf, extreme):
    """Valid but extreme settings past float32's range made NaN or inf logits, from which the
    sampler returned token 0, outside allowed_token_ids; they now saturate."""
    llm, _ = llm_and_hf
    kwargs = dict(allowed_token_ids=[5, 6, 9], seed=3, max_tokens=4, ignore_eos=True)
    params = SamplingParams(**kwargs, **extreme)
    (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= {5, 6, 9}, out.outputs[0].token_ids


def test_an_error_mid_generate_aborts_that_calls_requests(llm_and_hf, monkeypatch):
    """An exception (or Ctrl-C) while a batch runs aborts its requests: their KV blocks are free
    and the next generate() runs only its own prompts, correctly."""
    llm, _ = llm_and_hf
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (expected,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    kv = llm.engine.kv_cache_manager
    free = kv.num_free_blocks
    step, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9] * 20], params, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.scheduler.has_unfinished_requests()
    assert not llm.output_processor.requests
    assert kv.num_free_blocks == free
    (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_generate_defers_full_collections_only_while_it_steps(llm_and_hf, monkeypatch):
    """While generate() and stream() step, no full collection runs (their thresholds out of
    reach) and nothing is frozen; after them, even on an error, the thresholds are back. Where
    the caller froze objects before, that freeze stays as it was, and what was alive during the
    call is collectable once dropped (a freeze left in place kept dropped LLMs, KV caches and all,
    for good)."""
    import gc
    import weakref

    llm, _ = llm_and_hf
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    class Node:
        pass

    def garbage_cycle() -> weakref.ref:
        node = Node()
        node.self = node
        return weakref.ref(node)

    step = llm.engine.step
    in_steps = []  # (frozen objects, full-collection threshold) at each step

    def recording_step():
        in_steps.append((gc.get_freeze_count(), gc.get_threshold()[2]))
        return step()

    monkeypatch.setattr(llm.engine, "step", recording_step)
    threshold = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    dead_before = garbage_cycle()
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert "".join(llm.stream([5, 6, 7], params)) is not None
    assert in_steps and min(full for _, full in in_steps) > 10**9
    # Frozen objects freed by reference counting leave the count: it can only fall.
    assert max(frozen for frozen, _ in in_steps) <= frozen_before
    assert gc.get_threshold() == threshold
    gc.collect()
    assert dead_before() is None

    def failing_step():
        raise RuntimeError("a step failed")

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="a step failed"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert gc.get_threshold() == threshold
    monkeypatch.setattr(llm.engine, "step", recording_step)

    gc.freeze()  # frozen before (by the caller, a library, or an in-process server)
    try:
        frozen_before = gc.get_freeze_count()
        alive_in_call = Node()
        alive_in_call.self = alive_in_call
        dropped_after = weakref.ref(alive_in_call)
        in_steps.clear()
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert in_steps and max(frozen for frozen, _ in in_steps) <= frozen_before
        assert min(full for _, full in in_steps) > 10**9
        assert gc.get_freeze_count() <= frozen_before and gc.get_threshold() == threshold
        del alive_in_call
        gc.collect()
        assert dropped_after() is None
    finally:
        gc.unfreeze()


def test_an_assistant_message_without_content_renders_as_empty_text():
    """A tool-calling assistant's content None reaches string-content templates as "" (as vLLM
    hands it to them): SmolLM2's template concatenated None and raised a TypeError."""
    from kvik.engine.input_processor import flatten_text_parts

    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    assert flatten_text_parts(messages) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]


def tokenizer_only_processor(folder):
    """An InputProcessor over the tiny tokenizer, with no model behind it."""
    from types import SimpleNamespace

    from tiny_models import save_tiny_tokenizer

    from kvik.engine.input_processor import InputProcessor

    model = SimpleNamespace(
        tokenizer=None,
        path=save_tiny_tokenizer(folder),
        eos_token_ids=lambda: {2},
        vocab_size=256,
        max_model_len=64,
        max_logprobs=20,
    )
    return InputProcessor(model)


def test_a_chat_template_that_fails_on_the_messages_is_a_value_error(tmp_path):
    """A given template whose own code raises a Python error (not a jinja2 one) is the
    request's fault: it was a bare ZeroDivisionError or TypeError from inside jinja2."""
    processor = tokenizer_only_processor(tmp_path)
    hi = [{"role": "user", "content": "hi"}]
    for template, error in (
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages + 1 }}", "TypeError"),
    ):
        with pytest.raises(ValueError, match=f"the given chat_template failed: {error}"):
            processor.apply_chat_template(hi, chat_template=template)
    assert processor.apply_chat_template(hi)["prompt"] == "<s><user>hi\n<assistant>"


def test_stop_strings_and_bad_words_must_be_valid_unicode(tmp_path):
    """A stop string holding a lone surrogate (JSON can carry one) can never be found in an
    output: it was silently never applied. Both fields are refused by name."""
    processor = tokenizer_only_processor(tmp_path)
    for name in ("stop", "bad_words"):
        with pytest.raises(ValueError, match=f"SamplingParams.{name}: text must be valid Unicode"):
            processor.process("hi", SamplingParams(**{name: ["ok", "\ud800"]}))
    assert processor.process("hi", SamplingParams(stop=["ok"], bad_words=["x"]))[1] == [
        ord("h") - 29,
        ord("i") - 29,
    ]
