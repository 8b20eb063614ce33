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
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from kvik.spec_decode.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    save_eagle3_head,
)
from kvik.spec_decode.eagle3_eval import evaluate_acceptance, target_features
from kvik.spec_decode.train_eagle3_prompts import (
    held_out_instructions,
    num_training_instructions,
    training_instructions,
    validation_instructions,
)

logger = logging.getLogger(__name__)


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


def default_engine(dtype: str = "bfloat16"):
    """kvik's engine on the default model, for generating answers (much faster on the CPU than
    transformers' generate, bf16 faster still)."""
    from kvik import LLM

    return LLM(dtype=dtype, max_model_len=1024, num_kv_blocks=4096, enforce_eager=True)


def engine_greedy_continuations(
    llm, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """As ``greedy_continuations``, with kvik's engine. The text is only the context the head
    learns in: its labels come from the target's fp32 pass over it, so where the engine's greedy
    (bf16) parts from fp32 greedy, the labels still say what the fp32 target predicts."""
    from kvik import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]


@dataclass
class Example:
    token_ids: Tensor  # [T]
    aux_hidden: Tensor  # [T, 3 * hidden], the target's states at each position
    #: [T], the target's greedy next token after each position; -1 where no loss is taken (the
    #: prompt: drafting starts after it)
    labels: Tensor


@torch.no_grad()
def collect_examples(
    target,
    sequences: list[list[int]],
    aux_ids: list[int],
    batch_size: int = 8,
    prompt_lengths: list[int] | None = None,
) -> list[Example]:
    """One target pass per batch of sequences, padded on the right (causal attention keeps the
    padding out of the real positions). With ``prompt_lengths``, the labels of prompt positions
    are -1: a draft is only ever made after the prompt (its first draft predicts the token after
    the first answer token), so the loss covers the answer, as EAGLE-3's trainers mask it."""
    examples = []
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in batch])
        greedy, aux = target_features(target, ids, aux_ids)
        for i, seq in enumerate(batch):
            n = len(seq)
            labels = greedy[i, :n].clone()
            if prompt_lengths is not None:
                labels[: prompt_lengths[start + i]] = -1
            examples.append(Example(ids[i, :n], aux[i, :n].to(torch.bfloat16), labels))
        logger.info("target features: %d/%d sequences", len(examples), len(sequences))
    return examples


def save_examples(examples: list[Example], path: str | Path) -> None:
    lengths = torch.tensor([e.token_ids.numel() for e in examples])
    tensors = {
        "lengths": lengths,
        "token_ids": torch.cat([e.token_ids for e in examples]),
        "aux_hidden": torch.cat([e.aux_hidden for e in examples]),
        "labels": torch.cat([e.labels for e in examples]),
    }
    tmp = Path(f"{path}.partial")
    save_file(tensors, str(tmp))
    tmp.replace(path)  # a chunk file is either whole or absent


def load_examples(path: str | Path) -> list[Example]:
    tensors = load_file(str(path))
    splits = tensors["lengths"].tolist()
    parts = (tensors[name].split(splits) for name in ("token_ids", "aux_hidden", "labels"))
    return [Example(*fields) for fields in zip(*parts, strict=True)]


def build_dataset(
    target,
    tokenizer,
    folder: str | Path,
    instructions: list[str],
    name: str,
    max_new_tokens: int,
    chunk_size: int = 128,
) -> list[Example]:
    """Examples for ``instructions``, in chunk files ``folder/name-new{max_new_tokens}-S-E``
    (instructions S..E-1): each chunk's instructions are answered by the engine, then passed
    through the target. Chunks already on disk are loaded instead of computed again, so a run can
    be resumed and runs with more instructions reuse the chunks of runs with fewer (``name`` must
    stand for one list of instructions whose prefixes these are)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    examples: list[Example] = []
    llm = None
    for start in range(0, len(instructions), chunk_size):
        end = min(start + chunk_size, len(instructions))
        path = folder / f"{name}-new{max_new_tokens}-{start:05d}-{end:05d}.safetensors"
        if not path.is_file():
            prompts = chat_prompt_ids(tokenizer, instructions[start:end])
            llm = llm or default_engine()
            sequences = engine_greedy_continuations(llm, prompts, max_new_tokens)
            chunk = collect_examples(
                target, sequences, aux_ids, prompt_lengths=[len(p) for p in prompts]
            )
            save_examples(chunk, path)
        examples += load_examples(path)
        logger.info("%s: %d/%d instructions", name, len(examples), len(instructions))
    return examples


def frequent_target_ids(examples: list[Example], vocab_size: int, size: int) -> Tensor:
    """The draft vocabulary: the ``size`` target ids the target predicts most often, sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for example in examples:
        labels = example.labels[example.labels >= 0]
        counts += torch.bincount(labels, minlength=vocab_size)
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
    tokens, and each step's top-1 accuracy over the labelled positions. A target token outside
    the draft vocabulary can't be drafted: no loss, and a miss in the accuracy."""
    tokens, aux, labels = _pad(examples)
    vocab = head.config.vocab_size
    to_draft = torch.full((vocab + 1,), -1, dtype=torch.int64)
    draft_ids = torch.arange(head.config.draft_vocab_size)
    to_draft[head.draft_to_target(draft_ids)] = draft_ids
    total, accuracies = torch.zeros(()), []
    step_logits = training_time_test_logits(head, tokens, head.combine(aux), num_steps)
    for step, logits in enumerate(step_logits):
        # The target's token after position t + step + 1; -1 (padding, prompt) is ignored.
        target_ids = labels[:, step + 1 : step + 1 + logits.shape[1]]
        wanted = to_draft[torch.where(target_ids < 0, vocab, target_ids)]
        loss = F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), ignore_index=-1)
        total = total + step_decay**step * loss
        hits = (logits.argmax(-1) == wanted) & (wanted >= 0)
        accuracies.append(float(hits.sum()) / max(1, int((target_ids >= 0).sum())))
    return total, accuracies


def expected_accepted(accuracies: list[float]) -> float:
    """Drafts accepted per verification if step l's top-1 accuracy (given the steps before it
    right) held at every position: a0 + a0 a1 + a0 a1 a2 + ..."""
    total, run = 0.0, 1.0
    for accuracy in accuracies:
        run *= accuracy
        total += run
    return total


@torch.no_grad()
def validate(
    head: Eagle3Head, examples: list[Example], num_steps: int, batch_size: int = 16
) -> list[float]:
    """Top-1 accuracy per draft step over ``examples`` (weighted by their labelled positions)."""
    was_training = head.training
    head.eval()
    hits, count = [0.0] * num_steps, 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        n = sum(int((e.labels >= 0).sum()) for e in batch)
        _, accuracies = training_time_test_loss(head, batch, num_steps)
        hits = [h + a * n for h, a in zip(hits, accuracies, strict=False)]
        count += n
    head.train(was_training)
    return [h / max(1, count) for h in hits]


def train_head(
    head: Eagle3Head,
    examples: list[Example],
    steps: int,
    batch_size: int = 8,
    lr: float = 1e-3,
    num_ttt_steps: int = 3,
    seed: int = 0,
    log_every: int = 10,
    weight_decay: float = 0.0,
    validation: list[Example] | None = None,
    validate_every: int = 100,
) -> list[tuple[int, float]]:
    """AdamW with a linear warm-up and a cosine decay, batches of examples shuffled once per
    epoch. With ``validation``, the head ends with the weights that validated best (by
    ``expected_accepted``): past that point it fits its training answers, not the task.
    Returns the validation history, (step, expected accepted) pairs."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda i: (
            min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
        ),
    )
    best_score, best_state, history = -1.0, None, []
    order: list[Example] = []
    head.train()
    for step in range(steps):
        if len(order) < batch_size:
            order = rng.sample(examples, len(examples))
        batch, order = order[:batch_size], order[batch_size:]
        loss, accuracies = training_time_test_loss(head, batch, num_ttt_steps)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            accs = " ".join(f"{a:.2f}" for a in accuracies)
            logger.info("step %d/%d loss %.3f top-1 per draft step %s", step, steps, loss, accs)
        if validation and ((step + 1) % validate_every == 0 or step == steps - 1):
            accuracies = validate(head, validation, num_ttt_steps)
            score = expected_accepted(accuracies)
            accs = " ".join(f"{a:.3f}" for a in accuracies)
            logger.info("step %d validation top-1 %s, expected accepted %.3f", step, accs, score)
            history.append((step, score))
            if score > best_score:
                best_score = score
                best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    if best_state is not None:
        head.load_state_dict(best_state)
        logger.info("kept the weights that validated best (expected accepted %.3f)", best_score)
    head.eval()
    return history


def evaluation_instructions(count: int, seed: int) -> list[str]:
    """``count`` of the held-out instructions, drawn with ``seed``."""
    held_out = held_out_instructions()
    return random.Random(seed).sample(held_out, min(count, len(held_out)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to save the head in")
    parser.add_argument(
        "--data-dir",
        help="folder for the generated training data, reused by later runs (default: OUT-data)",
    )
    parser.add_argument(
        "--train-prompts",
        type=int,
        default=1024,
        help=f"how many of the {num_training_instructions()} training instructions to answer",
    )
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--draft-vocab-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--validate-every", type=int, default=100, help="training steps")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--data-only", action="store_true", help="generate the training data, then stop"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    started = time.time()
    target, tokenizer = load_default_target()
    data_dir = args.data_dir or f"{args.out.rstrip('/')}-data"
    val_examples = build_dataset(
        target, tokenizer, data_dir, validation_instructions(), "validation", args.max_new_tokens
    )
    examples = build_dataset(
        target, tokenizer, data_dir,
        training_instructions(args.train_prompts, args.seed), f"train-seed{args.seed}",
        args.max_new_tokens,
    )  # fmt: skip
    if args.data_only:
        return
    draft_ids = frequent_target_ids(examples, target.config.vocab_size, args.draft_vocab_size)
    head = new_head(target, draft_ids)
    for name, data in (("training", examples), ("validation", val_examples)):
        tokens = sum(e.token_ids.numel() for e in data)
        answer_tokens = sum(int((e.labels >= 0).sum()) for e in data)
        print(f"{name} data: {len(data)} sequences, {tokens} tokens, {answer_tokens} labelled")
    trained = time.time()
    train_head(
        head, examples, args.steps, args.batch_size, args.lr, seed=args.seed,
        weight_decay=args.weight_decay, validation=val_examples,
        validate_every=args.validate_every,
    )  # fmt: skip
    print(f"training time {time.time() - trained:.0f} s")
    save_eagle3_head(head, args.out)
    logger.info("saved the head in %s", args.out)

    from kvik.spec_decode.eagle3 import load_eagle3_head

    loaded = load_eagle3_head(args.out, target.get_input_embeddings())
    evaluated = chat_prompt_ids(tokenizer, evaluation_instructions(args.eval_prompts, args.seed))
    stats = evaluate_acceptance(
        target, loaded, evaluated, k=3, max_new_tokens=args.eval_new_tokens, check_against_plain=2
    )
    print(f"held-out, k=3, greedy: {stats.summary()}")
    print(f"total time {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
