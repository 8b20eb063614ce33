"""Measurement of an EAGLE-3 head: greedy speculative decoding with k drafts a step, counting how
many the target accepts; offline with the target in transformers (``evaluate_acceptance``), or
through kvik's engine and the runner's proposer (``engine_acceptance``).

The offline output is the target's own greedy text by construction; ``check_against_plain``
compares it with plain greedy decoding all the same.

    python -m kvik.spec_decode.eagle3_eval --head DIR   # the default model, held-out prompts
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from kvik.spec_decode.eagle3 import Eagle3Head
from kvik.spec_decode.metrics import SpecDecodingStats


def cache_kwargs(model, cache) -> dict:
    """The keyword arguments that give a transformers model's forward ``cache`` to read and extend:
    transformers renamed forward's ``past_key_values`` to ``cache`` after 5.17 (5.25 warns that
    the old name goes in 5.40); 5.17 knows only ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}


@torch.no_grad()
def target_features(target, token_ids: Tensor, aux_layer_ids: list[int]) -> tuple[Tensor, Tensor]:
    """One target pass over token_ids [B, T]: (greedy next tokens [B, T], the aux layers' hidden
    states concatenated [B, T, 3 * hidden])."""
    out = target(input_ids=token_ids, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    return out.logits.argmax(-1), aux


@dataclass
class SpeculativeRun:
    output_ids: list[int]
    stats: SpecDecodingStats


@torch.no_grad()
def speculative_greedy(
    target, head: Eagle3Head, prompt_ids: list[int], k: int, max_new_tokens: int
) -> SpeculativeRun:
    """Greedy decoding of one prompt with the head's k drafts verified by the target.

    The target keeps a KV cache: each step feeds the newest token and the k drafts, then drops
    the rejected drafts' entries (``DynamicCache.crop``) and keeps the accepted positions' states.
    """
    from transformers import DynamicCache

    aux_ids = head.config.eagle_aux_hidden_state_layer_ids
    if aux_ids is None:
        raise ValueError("the head's config names no eagle_aux_hidden_state_layer_ids")
    stats = SpecDecodingStats(num_spec_tokens=k)
    cache = DynamicCache()
    greedy, aux = _cached_pass(target, prompt_ids, cache, aux_ids)
    sequence = list(prompt_ids) + [int(greedy[-1])]
    states = aux  # the target's states at positions 0..len(sequence) - 2
    while len(sequence) - len(prompt_ids) < max_new_tokens:
        # Rows 0..n-2 of the head: token p + 1 with the target's state at p.
        hidden = head.combine(states.to(head.fc.weight.dtype))
        drafts = head.propose_greedy(torch.tensor(sequence[1:]), hidden, k).tolist()
        greedy, aux = _cached_pass(target, [sequence[-1]] + drafts, cache, aux_ids)
        accepted = 0
        while accepted < k and drafts[accepted] == greedy[accepted]:
            accepted += 1
        stats.observe_draft(num_draft_tokens=k, num_accepted_tokens=accepted)
        # Keep the states (and cache) of the fed token and the accepted drafts only.
        states = torch.cat([states, aux[: accepted + 1]])
        rejected = k - accepted
        if rejected:  # a negative crop removes that many entries (transformers 5.18's form)
            cache.crop(-rejected)
        sequence += drafts[:accepted] + [int(greedy[accepted])]
    return SpeculativeRun(sequence[len(prompt_ids) :][:max_new_tokens], stats)


def _cached_pass(target, token_ids: list[int], cache, aux_ids: list[int]) -> tuple[Tensor, Tensor]:
    """The target over new tokens after what ``cache`` holds: (greedy next tokens [n], aux states
    [n, 3 * hidden])."""
    out = target(
        input_ids=torch.tensor([token_ids]),
        output_hidden_states=True,
        **cache_kwargs(target, cache),
    )
    aux = torch.cat([out.hidden_states[i][0] for i in aux_ids], dim=-1)
    return out.logits[0].argmax(-1), aux


@torch.no_grad()
def plain_greedy(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """One token a step, with a KV cache; like the speculative loop, it does not stop at EOS."""
    from transformers import DynamicCache

    cache, fed, output = DynamicCache(), list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = target(input_ids=torch.tensor([fed]), **cache_kwargs(target, cache)).logits
        fed = [int(logits[0, -1].argmax())]
        output += fed
    return output


def evaluate_acceptance(
    target,
    head: Eagle3Head,
    prompts: list[list[int]],
    k: int = 3,
    max_new_tokens: int = 48,
    check_against_plain: int = 0,
) -> SpecDecodingStats:
    """Acceptance over held-out prompts (token ids). ``check_against_plain``: for that many
    prompts, also decode plainly and raise if the outputs differ (they must not)."""
    total = SpecDecodingStats(num_spec_tokens=k)
    for i, prompt in enumerate(prompts):
        run = speculative_greedy(target, head, prompt, k, max_new_tokens)
        total.merge(run.stats)
        if i < check_against_plain:
            plain = plain_greedy(target, prompt, max_new_tokens)
            if plain != run.output_ids:
                raise AssertionError(
                    f"prompt {i}: speculative output differs from plain greedy decoding"
                )
    return total


def engine_acceptance(
    head_folder: str,
    prompts: list[list[int]],
    k: int = 3,
    max_new_tokens: int = 48,
    dtype: str = "float32",
    model: str | None = None,
) -> SpecDecodingStats:
    """Acceptance of the head through kvik's engine (the runner's ``Eagle3Proposer``) on
    ``model`` (default: the default model), greedy, not stopping at EOS as the offline loop."""
    from kvik import LLM, SamplingParams

    speculative = {"method": "eagle3", "model": str(head_folder), "num_speculative_tokens": k}
    llm = LLM(model, dtype=dtype, max_model_len=1024, speculative_config=speculative)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm.stats.spec_decoding


def main(argv: list[str] | None = None) -> None:
    from kvik.spec_decode import train_eagle3 as trainer
    from kvik.spec_decode.eagle3 import load_eagle3_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", required=True, help="the head's folder")
    parser.add_argument("--prompts", type=int, default=16, help="held-out instructions")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--skip-offline", action="store_true", help="the engine's figure only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = trainer.load_default_target()
    instructions = trainer.evaluation_instructions(args.prompts, args.seed)
    prompts = trainer.chat_prompt_ids(tokenizer, instructions)
    stats = engine_acceptance(args.head, prompts, args.k, args.new_tokens)
    print(f"held-out, k={args.k}, greedy, kvik's engine (fp32): {stats.summary()}")
    if not args.skip_offline:
        head = load_eagle3_head(args.head, target.get_input_embeddings())
        stats = evaluate_acceptance(target, head, prompts, args.k, args.new_tokens)
        print(f"held-out, k={args.k}, greedy, offline (transformers, fp32): {stats.summary()}")


if __name__ == "__main__":
    main()
