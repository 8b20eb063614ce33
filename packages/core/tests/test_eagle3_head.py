"""EAGLE-3 heads: the public checkpoints' layout, save/load round trip, training-time test that
matches drafting, a few training steps on a tiny random target, and the offline acceptance
measure (whose speculative output must equal plain greedy decoding)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvik.spec_decode import train_eagle3 as trainer
from kvik.spec_decode.eagle3 import Eagle3Config, Eagle3Head, load_eagle3_head, save_eagle3_head
from kvik.spec_decode.eagle3_eval import evaluate_acceptance

VOCAB, HIDDEN, LAYERS = 64, 32, 6
AUX = [1, 3, 4]


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def examples(target):
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (6,), generator=generator).tolist() for _ in range(8)]
    sequences = trainer.greedy_continuations(target, prompts, max_new_tokens=12, batch_size=4)
    assert all(len(s) == 18 for s in sequences)
    return prompts, trainer.collect_examples(target, sequences, AUX)


def make_head(target, examples, draft_vocab=48):
    draft_ids = trainer.frequent_target_ids(examples, VOCAB, draft_vocab)
    head = trainer.new_head(target, draft_ids)
    head.config.eagle_aux_hidden_state_layer_ids = AUX
    return head


def test_layout_of_the_public_checkpoints(target, examples, tmp_path):
    head = make_head(target, examples[1])
    save_eagle3_head(head, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    heads_dim = 4 * 8
    assert shapes == {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": (HIDDEN,),
        "midlayer.hidden_norm.weight": (HIDDEN,),
        "midlayer.post_attention_layernorm.weight": (HIDDEN,),
        "midlayer.self_attn.q_proj.weight": (heads_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (2 * 8, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (2 * 8, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, heads_dim),
        "midlayer.mlp.gate_proj.weight": (64, HIDDEN),
        "midlayer.mlp.up_proj.weight": (64, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, 64),
        "norm.weight": (HIDDEN,),
        "lm_head.weight": (48, HIDDEN),
        "d2t": (48,),
        "t2d": (VOCAB,),
    }
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == 48 and config["vocab_size"] == VOCAB
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # d2t maps each draft id onto the target id it stands for; t2d marks those target ids.
    targets = torch.arange(48) + tensors["d2t"]
    assert targets.tolist() == trainer.frequent_target_ids(examples[1], VOCAB, 48).tolist()
    assert tensors["t2d"].sum() == 48 and tensors["t2d"][targets].all()


def test_training_time_test_matches_drafting(target, examples):
    """Step l's logits at anchor t in training equal what drafting computes: a causal pass over
    target-fed rows 0..t, then rows fed with the head's own outputs."""
    head = make_head(target, examples[1])
    torch.nn.init.normal_(head.midlayer.self_attn.q_proj.weight, std=0.3)  # attention not flat
    example = examples[1][0]
    tokens, hidden = example.token_ids, head.combine(example.aux_hidden.float())
    with torch.no_grad():
        steps = trainer.training_time_test_logits(head, tokens[None], hidden[None], 3)
        for anchor in (0, 4, 11):
            rows_tokens, rows_hidden = tokens[1 : anchor + 2], hidden[: anchor + 1]
            for step in range(3):
                positions = torch.arange(rows_tokens.numel())
                logits, prenorm = head(rows_tokens[None], rows_hidden[None], positions)
                torch.testing.assert_close(logits[0, -1], steps[step][0, anchor])
                rows_tokens = tokens[1 : anchor + step + 3]
                rows_hidden = torch.cat([rows_hidden, prenorm[0, -1:]])


def test_train_save_load_round_trip(target, examples, tmp_path):
    prompts, data = examples
    head = make_head(target, data)
    before, _ = trainer.training_time_test_loss(head, data, 3)
    trainer.train_head(head, data, steps=30, batch_size=4, lr=3e-3, log_every=0)
    after, _ = trainer.training_time_test_loss(head, data, 3)
    assert after < before  # it learns
    save_eagle3_head(head, tmp_path)
    loaded = load_eagle3_head(tmp_path, target.get_input_embeddings())
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = data[0].token_ids[None]
    hidden = head.combine(data[0].aux_hidden.float())[None]
    positions = torch.arange(tokens.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(tokens, hidden, positions), head(tokens, hidden, positions)
        )
    drafts = loaded.propose_greedy(tokens[0], hidden[0], 3)
    assert drafts.shape == (3,) and loaded.t2d[drafts].all()  # target ids the draft vocab holds
    stats = evaluate_acceptance(
        target, loaded, prompts[:3], k=3, max_new_tokens=10, check_against_plain=3
    )
    assert stats.num_drafts > 0 and stats.num_draft_tokens == 3 * stats.num_drafts
    assert 1.0 <= stats.mean_accepted_length <= 4.0


def test_loading_checks_the_layout(target, examples, tmp_path):
    head = make_head(target, examples[1])
    save_eagle3_head(head, tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    # A head that carries its own embedding uses it.
    save_file({**tensors, "embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}, str(weights))
    own = load_eagle3_head(tmp_path)
    assert own.embed_tokens is not None
    assert torch.equal(own.embed(torch.tensor([3]))[0], own.embed_tokens.weight[3])
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="pass the target's embedding"):
        load_eagle3_head(tmp_path).embed(torch.tensor([1]))
    del tensors["norm.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_eagle3_head(tmp_path, target.get_input_embeddings())
    tensors["norm.weight"] = torch.ones(HIDDEN + 1)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="norm.weight has shape"):
        load_eagle3_head(tmp_path, target.get_input_embeddings())
    with pytest.raises(FileNotFoundError, match="not an EAGLE-3 head folder"):
        load_eagle3_head(tmp_path / "missing")


def test_config_from_public_checkpoint_keys():
    # The keys of a public head's config.json (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's shape).
    config = Eagle3Config.from_dict(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "draft_vocab_size": 32000,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 2048,
            "torch_dtype": "float16",
            "model_type": "llama",
            "num_hidden_layers": 1,
        }
    )
    assert config.head_dim == 128 and config.target_hidden_size == 4096
    with torch.device("meta"):  # the shapes only: no 8B-sized allocation
        head = Eagle3Head(config)
    assert head.midlayer.self_attn.q_proj.weight.shape == (4096, 8192)
    assert head.fc.weight.shape == (4096, 3 * 4096)
    with pytest.raises(ValueError, match="lacks hidden_size"):
        Eagle3Config.from_dict({"vocab_size": 10})
    with pytest.raises(ValueError, match="draft_vocab_size must be"):
        Eagle3Config.from_dict({**vars(config), "draft_vocab_size": 10**6})


def test_held_out_topics_never_reach_training():
    import re

    from kvik.spec_decode import train_eagle3_prompts as prompts

    stop = {"the", "of", "a"}
    held_out_words = {
        word.lower()
        for topic in prompts.held_out_topics() + prompts.validation_topics()
        for word in re.findall(r"\w+", topic)
        if word.lower() not in stop
    }
    everything = prompts.training_instructions(prompts.num_training_instructions())
    assert len(set(everything)) == len(everything)
    for text in everything:
        assert not held_out_words & {w.lower() for w in re.findall(r"\w+", text)}, text
    assert not set(everything) & set(prompts.held_out_instructions())
    assert not set(prompts.validation_instructions()) & set(prompts.held_out_instructions())
    # A smaller count is a prefix of a larger one, so cached data chunks stay valid.
    assert (
        prompts.training_instructions(300, seed=3)
        == prompts.training_instructions(900, seed=3)[:300]
    )
    with pytest.raises(ValueError, match="count must be in"):
        prompts.training_instructions(0)


def test_prompt_positions_carry_no_loss(target, examples, tmp_path):
    prompts, data = examples
    sequences = [e.token_ids.tolist() for e in data[:3]]
    masked = trainer.collect_examples(
        target, sequences, AUX, prompt_lengths=[len(p) for p in prompts[:3]]
    )
    for plain, example, prompt in zip(data[:3], masked, prompts, strict=False):
        assert (example.labels[: len(prompt)] == -1).all()
        assert torch.equal(example.labels[len(prompt) :], plain.labels[len(prompt) :])
    counts = trainer.frequent_target_ids(masked, VOCAB, 8)  # ignores the -1 labels
    assert counts.numel() == 8
    trainer.save_examples(masked, tmp_path / "chunk.safetensors")
    for saved, loaded in zip(masked, trainer.load_examples(tmp_path / "chunk.safetensors")):
        assert torch.equal(saved.token_ids, loaded.token_ids)
        assert torch.equal(saved.aux_hidden, loaded.aux_hidden)
        assert torch.equal(saved.labels, loaded.labels)


def test_training_keeps_the_weights_that_validated_best(target, examples):
    _, data = examples
    head = make_head(target, data)
    history = trainer.train_head(
        head, data[:6], steps=12, batch_size=2, lr=3e-2, log_every=0,
        validation=data[6:], validate_every=3,
    )  # fmt: skip
    assert [step for step, _ in history] == [2, 5, 8, 11]
    accuracies = trainer.validate(head, data[6:], 3)
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert trainer.expected_accepted(accuracies) == pytest.approx(max(s for _, s in history))
    assert trainer.expected_accepted([0.5, 0.5, 0.5]) == pytest.approx(0.875)
