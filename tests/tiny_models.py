"""Tiny random-weight models saved by transformers, and helpers to compare kvik against them."""

from __future__ import annotations

from pathlib import Path

import torch

# Large initialisation so next-token distributions are peaked and greedy ties are rare.
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(
            **_COMMON,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**_COMMON, sliding_window=12, head_dim=16),
        "qwen2": Qwen2Config(**_COMMON),
        "qwen3": Qwen3Config(**_COMMON, head_dim=16),
    }


def build_tiny_model(kind: str, folder: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _configs()[kind]
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos
    return model.eval()


def ragged_prompts(
    count: int, seed: int, low: int = 5, high: int = 70, vocab: int = 256
) -> list[list[int]]:
    """Random prompts whose lengths are not multiples of 16."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        n = int(torch.randint(low, high, (1,), generator=g))
        if n % 16 == 0:
            n += 1
        prompts.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    return prompts


# A chat template for tiny_tokenizer: plain role markers, as the tiny model's vocabulary has no
# special chat tokens.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def save_tiny_tokenizer(folder: Path, vocab_size: int = 256) -> Path:
    """Save a character-level fast tokenizer with a chat template over the tiny models' vocabulary.

    Ids 0, 1, 2 are <unk>, <s> (BOS) and </s> (EOS), as in the tiny models' config; every other id
    is one printable character, so any id a random model samples decodes to visible text.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    chars += [chr(0x100 + i) for i in range(vocab_size - 3 - len(chars))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
