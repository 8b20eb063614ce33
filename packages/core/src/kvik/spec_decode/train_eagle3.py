"""Train an EAGLE-3 head on a target's own greedy generations, on the CPU.

    python -m kvik.spec_decode.train_eagle3 --out /tmp/eagle3-smollm2

The target (default: kvik's default model, SmolLM2-135M-Instruct, loaded by transformers from its
GGUF) answers generated instructions greedily; one pass over each answered sequence gives the
hidden states of three of its layers and its greedy next token at every position, the labels.
The head learns with "training-time test" (EAGLE-3): step l > 0 of a draft is fed the head's own
output of step l - 1, attending to the target-fed rows before its anchor and to its own chain, as
it will when drafting. Then the held-out instructions measure the mean accepted length at k = 3.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvik.spec_decode.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    save_eagle3_head,
)
from kvik.spec_decode.eagle3_eval import evaluate_acceptance, target_features

logger = logging.getLogger(__name__)

_TOPICS = (
    "volcanoes", "the moon", "honey bees", "the Roman empire", "photosynthesis", "chess",
    "rainbows", "the internet", "coffee", "glaciers", "the human heart", "electric cars",
    "the piano", "deserts", "penguins", "bread baking", "earthquakes", "the printing press",
    "solar panels", "whales", "the Olympic games", "vaccines", "tea", "the Amazon rainforest",
    "black holes", "bicycles", "the water cycle", "dinosaurs", "money", "the Eiffel tower",
    "recycling", "sleep", "the ocean tides", "libraries", "mountains", "the alphabet",
    "airplanes", "bananas", "friendship", "the weather", "trains", "the brain", "gardening",
    "clocks", "music", "spiders", "the stock market", "snow", "football", "robots",
    "the Nile", "cheese", "lightning", "mathematics", "owls", "the telephone", "forests",
    "birthdays", "maps", "the sun", "rivers", "castles", "cats", "dogs", "salt",
    "ancient Egypt", "the camera", "rice", "wind turbines", "the guitar", "coral reefs",
    "elephants", "paper", "the Great Wall of China", "oxygen", "kites", "pizza", "stars",
)  # fmt: skip
_TEMPLATES = (
    "Write a short paragraph about {}.",
    "Explain {} to a ten-year-old.",
    "What are three interesting facts about {}?",
    "Why is {} important?",
    "Describe the history of {} briefly.",
    "Give me a list of five words related to {}.",
)
#: The last topics are held out: evaluation prompts share no topic with training ones.
NUM_HELD_OUT_TOPICS = 8


def instruction_prompts(held_out: bool) -> list[str]:
    topics = _TOPICS[-NUM_HELD_OUT_TOPICS:] if held_out else _TOPICS[:-NUM_HELD_OUT_TOPICS]
    return [template.format(topic) for topic in topics for template in _TEMPLATES]


def load_default_target():
    """(model, tokenizer): the default model in transformers, fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvik.model_loader.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def chat_prompt_ids(tokenizer, instructions: list[str]) -> list[list[int]]:
    prompts = []
    for text in instructions:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding here, older releases a list of ids
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


@torch.no_grad()
def greedy_continuations(
    target, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """Each prompt followed by the target's greedy answer (to its end token or the limit)."""
    pad = 0
    sequences = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = target.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        eos = target.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for prompt, row in zip(batch, out[:, width:].tolist(), strict=True):
            answer = []
            for token in row:
                answer.append(token)
                if token in eos:
                    break
            sequences.append(prompt + answer)
    return sequences


def engine_greedy_continuations(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """As ``greedy_continuations``, with kvik's engine on the default model in fp32 (much faster
    on the CPU than transformers' generate; the labels still come from the transformers pass)."""
    from kvik import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024, num_kv_blocks=2048, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    del llm  # its KV cache is no longer needed
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]


@dataclass
class Example:
    token_ids: Tensor  # [T]
    aux_hidden: Tensor  # [T, 3 * hidden], the target's states at each position
    labels: Tensor  # [T], the target's greedy next token after each position


@torch.no_grad()
def collect_examples(
    target, sequences: list[list[int]], aux_ids: list[int], batch_size: int = 8
) -> list[Example]:
    """One target pass per batch of sequences, padded on the right (causal attention keeps the
    padding out of the real positions)."""
    examples = []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in batch])
        greedy, aux = target_features(target, ids, aux_ids)
        for i, seq in enumerate(batch):
            n = len(seq)
            examples.append(Example(ids[i, :n], aux[i, :n].to(torch.bfloat16), greedy[i, :n]))
        logger.info("target features: %d/%d sequences", len(examples), len(sequences))
    return examples


def frequent_target_ids(examples: list[Example], vocab_size: int, size: int) -> Tensor:
    """The draft vocabulary: the ``size`` target ids the target predicts most often, sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for example in examples:
        counts += torch.bincount(example.labels, minlength=vocab_size)
    counts = counts.float() + torch.linspace(1e-3, 0, vocab_size)  # ties: the lower id
    return counts.topk(min(size, vocab_size)).indices.sort().values


def head_config_for(target, draft_vocab_size: int) -> Eagle3Config:
    c = target.config
    from kvik.layers.rotary import rope_config

    base, scaling = rope_config(c)
    return Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=c.hidden_size,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=base,
        rope_scaling=scaling,
        max_position_embeddings=c.max_position_embeddings,
        eagle_aux_hidden_state_layer_ids=default_aux_layer_ids(c.num_hidden_layers),
    )


def new_head(target, draft_ids: Tensor) -> Eagle3Head:
    """A head over ``draft_ids``, its LM head and final norm started from the target's (the
    same vocabulary rows), sharing the target's embedding."""
    head = Eagle3Head(head_config_for(target, draft_ids.numel()), target.get_input_embeddings())
    head.set_vocab_map(draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
    return head


def _pad(examples: list[Example]) -> tuple[Tensor, Tensor, Tensor]:
    width = max(e.token_ids.numel() for e in examples)
    tokens = torch.zeros(len(examples), width, dtype=torch.int64)
    aux = torch.zeros(len(examples), width, examples[0].aux_hidden.shape[-1])
    labels = torch.full((len(examples), width), -1, dtype=torch.int64)
    for i, e in enumerate(examples):
        n = e.token_ids.numel()
        tokens[i, :n], aux[i, :n], labels[i, :n] = e.token_ids, e.aux_hidden.float(), e.labels
    return tokens, aux, labels


def training_time_test_logits(
    head: Eagle3Head, tokens: Tensor, hidden: Tensor, num_steps: int
) -> list[Tensor]:
    """Draft logits of steps 0..num_steps-1 for every anchor, as drafting would compute them.

    tokens [B, T], hidden [B, T, hidden] (the head's input from the target's states). Anchor t is
    the last target-fed row; step l's row sits at position t + l, is fed token t + l + 1 and the
    step l - 1 output at anchor t, and attends to the target-fed rows 0..t and to its own chain's
    rows 1..l. Step l's logits [B, T - l - 1, draft_vocab] cover anchors 0..T - l - 2."""
    layer, scale = head.midlayer, head.config.head_dim**-0.5
    width = tokens.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()
    keys, values, all_logits = [], [], []
    for step in range(num_steps):
        n = width - step - 1  # anchors with a token to feed at t + step + 1
        if n < 1:
            break
        positions = torch.arange(n, device=tokens.device) + step
        q, k, v, residual = layer.attention_inputs(
            head.embed(tokens[:, step + 1 : step + 1 + n]), hidden[:, :n], positions
        )
        keys.append(k)
        values.append(v)
        target_fed = q @ keys[0][:, :, :n].transpose(-1, -2) * scale
        scores = [target_fed.masked_fill(~causal[:n, :n], float("-inf"))]
        scores += [
            (q * keys[m][:, :, :n]).sum(-1, keepdim=True) * scale for m in range(1, step + 1)
        ]
        probs = torch.cat(scores, dim=-1).softmax(-1)
        attended = probs[..., :n] @ values[0][:, :, :n]
        for m in range(1, step + 1):
            attended = attended + probs[..., n + m - 1 : n + m] * values[m][:, :, :n]
        prenorm = layer.finish(attended, residual)
        all_logits.append(head.lm_head(head.norm(prenorm)))
        hidden = prenorm
    return all_logits


def training_time_test_loss(
    head: Eagle3Head, examples: list[Example], num_steps: int, step_decay: float = 0.8
) -> tuple[Tensor, list[float]]:
    """Cross-entropy over draft steps (weights step_decay**l) against the target's greedy
    tokens, and each step's top-1 accuracy. Targets outside the draft vocabulary are skipped."""
    tokens, aux, labels = _pad(examples)
    vocab = head.config.vocab_size
    to_draft = torch.full((vocab + 1,), -1, dtype=torch.int64)
    draft_ids = torch.arange(head.config.draft_vocab_size)
    to_draft[head.draft_to_target(draft_ids)] = draft_ids
    total, accuracies = torch.zeros(()), []
    step_logits = training_time_test_logits(head, tokens, head.combine(aux), num_steps)
    for step, logits in enumerate(step_logits):
        # The target's token after position t + step + 1; -1 (padding) is ignored.
        target_ids = labels[:, step + 1 : step + 1 + logits.shape[1]]
        wanted = to_draft[torch.where(target_ids < 0, vocab, target_ids)]
        loss = F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), ignore_index=-1)
        total = total + step_decay**step * loss
        valid = wanted >= 0
        hits = (logits.argmax(-1) == wanted) & valid
        accuracies.append(float(hits.sum()) / max(1, int(valid.sum())))
    return total, accuracies


def train_head(
    head: Eagle3Head,
    examples: list[Example],
    steps: int,
    batch_size: int = 8,
    lr: float = 1e-3,
    num_ttt_steps: int = 3,
    seed: int = 0,
    log_every: int = 10,
) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda i: (
            min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
        ),
    )
    head.train()
    for step in range(steps):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        loss, accuracies = training_time_test_loss(head, batch, num_ttt_steps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            accs = " ".join(f"{a:.2f}" for a in accuracies)
            logger.info("step %d/%d loss %.3f top-1 per draft step %s", step, steps, loss, accs)
    head.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to save the head in")
    parser.add_argument(
        "--train-prompts",
        type=int,
        default=160,
        help="how many of the training instructions to use",
    )
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--draft-vocab-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.time()
    target, tokenizer = load_default_target()
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    train_prompts = chat_prompt_ids(tokenizer, instruction_prompts(held_out=False))
    train_prompts = random.Random(args.seed).sample(train_prompts, args.train_prompts)
    logger.info("generating greedy answers to %d instructions", len(train_prompts))
    sequences = engine_greedy_continuations(train_prompts, args.max_new_tokens)
    examples = collect_examples(target, sequences, aux_ids)
    draft_ids = frequent_target_ids(examples, target.config.vocab_size, args.draft_vocab_size)
    head = new_head(target, draft_ids)
    logger.info("training on %d tokens", sum(e.token_ids.numel() for e in examples))
    train_head(head, examples, args.steps, args.batch_size, args.lr, seed=args.seed)
    save_eagle3_head(head, args.out)
    logger.info("saved the head in %s", args.out)

    from kvik.spec_decode.eagle3 import load_eagle3_head

    loaded = load_eagle3_head(args.out, target.get_input_embeddings())
    held_out = chat_prompt_ids(tokenizer, instruction_prompts(held_out=True))
    rng = random.Random(args.seed)
    held_out = rng.sample(held_out, min(args.eval_prompts, len(held_out)))
    stats = evaluate_acceptance(
        target, loaded, held_out, k=3, max_new_tokens=args.eval_new_tokens, check_against_plain=2
    )
    print(f"held-out, k=3, greedy: {stats.summary()}")
    print(f"total time {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
