"""Verifying draft tokens against the target so that the output has the target's distribution.

Layout (vLLM's, flattened): request i proposed ``num_draft_tokens[i]`` tokens (0 allowed), laid
end to end in ``draft_token_ids``; the target scored ``num_draft_tokens[i] + 1`` positions for it,
laid end to end in ``target_logits`` (the draft positions, then the bonus position).

Greedy requests keep the longest prefix of drafts equal to the target's argmax, then the target's
own token. Sampled requests (speculative sampling, Leviathan et al. / Chen et al.) accept draft d
at a position with probability min(1, p(d) / q(d)); at the first rejection they take a token from
norm(max(p - q, 0)); if all drafts pass, a bonus token from p at the last position. p is the
target's distribution after temperature, top-k, top-p and min-p, as kvik's sampler applies them;
q is the proposer's distribution, or "one-hot at its proposal" (``draft_probs=None``: n-gram and
other deterministic proposers, every proposer of kvik's), where the rule reads: accept with p(d),
else sample p without d.

With one-hot proposals the rule is carried out through the sampler's exponential race: each scored
row's token is argmax(p / E) over its noise E (the plain sampler's draw), and a draft is accepted
when it is that token. That happens with probability p(d), and a rejected position's token is the
race's winner among the others, which follows p without d: the rule above, with the token of a
position the same whether it had a draft or not. With a seeded request's noise a function of its
seed and the position (``kvik.layers.sampler.at_position``), its tokens are then the ones plain
sampling gives it, whatever drafts its steps verified: not their number (a token budget or
``disable_by_batch_size`` cuts them), not their values. With draft probabilities, acceptance
compares a uniform with p(d) / q(d), and the first rejection draws from norm(max(p - q, 0)) with
the position's noise; a seeded position draws its noise, then its uniform, from its own
generator, so its tokens depend on the batch only through the drafts it was given.

A batch of greedy requests only reads the target's argmax at each row back (one copy) and
compares on the host: a step's few dozen small launches and three reads would cost more than the
comparison. Otherwise, and where the caller keeps the result on the device (``on_device``: an
EAGLE-3 proposal starts from it before the host reads the step back), all of it runs on the
logits' device, batched, with no host synchronization (a seeded request adds host work and a
launch or two per scored position: ``at_position``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvik import ops
from kvik.layers.sampler import (
    _GREEDY_EPS,
    SamplingBatch,
    apply_top_k_top_p,
    at_position,
    greedy_ids,
)

#: Marks the slots after a request's last output token in ``RejectionOutput.token_ids``.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class RejectionOutput:
    #: [B, max_k + 1]: each request's accepted drafts, then its corrected or bonus token, then
    #: PLACEHOLDER_TOKEN_ID.
    token_ids: Tensor
    #: [B]: how many drafts each request accepted (its output has one token more).
    num_accepted: Tensor

    #: The read-back ``start_copy`` began: pinned host rows and the event of their copy.
    _copy: tuple[Tensor, torch.Event] | None = field(default=None, repr=False, compare=False)

    def _both(self) -> Tensor:
        # Tokens and counts side by side: one read of both (one wait for the device, not two).
        return torch.cat([self.token_ids, self.num_accepted.unsqueeze(1)], dim=1)

    def start_copy(self) -> None:
        """Begin the read-back to the host without waiting for it, so that ``to_lists`` waits
        for this copy alone and not for work queued behind it (the drafts a proposer launches
        from these tokens). Nothing to do on the CPU."""
        if self.token_ids.device.type == "cpu":
            return
        both = self._both()
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        copied = torch.Event(both.device.type)
        copied.record()
        self._copy = (host, copied)

    def to_lists(self) -> list[list[int]]:
        if self._copy is None:
            both = self._both().tolist()
        else:
            host, copied = self._copy
            copied.synchronize()
            both = host.tolist()
        return [row[: row[-1] + 1] for row in both]


@dataclass
class _Layout:
    """Where each request's drafts and target rows sit in the flattened inputs."""

    valid: Tensor  # [B, K] bool: j < k_i
    draft_index: Tensor  # [B, K] into draft_token_ids (0 where invalid)
    target_index: Tensor  # [B, K + 1] into target_logits (the bonus row where j > k_i)
    num_draft: Tensor  # [B]
    row_request: Tensor  # [R] the request of each target row

    @classmethod
    def build(cls, num_draft_tokens: list[int], device: torch.device) -> _Layout:
        # From the host without waiting for the device (a pageable copy is staged at once).
        num_draft = torch.tensor(num_draft_tokens, dtype=torch.int64).to(device, non_blocking=True)
        k_max = max(num_draft_tokens, default=0)
        j = torch.arange(k_max + 1, device=device)
        cu_draft = torch.cumsum(num_draft, 0) - num_draft  # each request's first draft
        first_row = cu_draft + torch.arange(len(num_draft_tokens), device=device)
        valid = j[:k_max].unsqueeze(0) < num_draft.unsqueeze(1)
        draft_index = torch.where(valid, cu_draft.unsqueeze(1) + j[:k_max], 0)
        target_index = first_row.unsqueeze(1) + torch.minimum(j, num_draft.unsqueeze(1))
        row_request = torch.repeat_interleave(
            torch.arange(len(num_draft_tokens), device=device),
            num_draft + 1,
            output_size=sum(num_draft_tokens) + len(num_draft_tokens),  # no read-back of the size
        )
        return cls(valid, draft_index, target_index, num_draft, row_request)


def target_probs(logits: Tensor, sampling: SamplingBatch, row_request: Tensor) -> Tensor:
    """The target's distribution at each row [R, V] after the request's temperature, top-k,
    top-p and min-p (kvik's sampler's filters, renormalised). Greedy requests' rows come out as
    temperature-1 softmax; the caller uses their argmax."""
    temperature = sampling.temperature[row_request]
    temperature = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
    logits = apply_top_k_top_p(
        logits.float() / temperature.unsqueeze(1),
        sampling.top_k[row_request] if sampling.use_top_k else None,
        sampling.top_p[row_request] if sampling.use_top_p else None,
    )
    probs = logits.softmax(dim=-1)
    if sampling.use_min_p:
        floor = sampling.min_p[row_request].unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class RejectionSampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed of their own
        self._seeded = torch.Generator(generator.device)  # reseeded per seeded position
        self._argmax_rows = ops.small_op("argmax_rows")  # as the Sampler's

    def __call__(
        self,
        target_logits: Tensor,
        draft_token_ids: Tensor,
        num_draft_tokens: list[int],
        sampling: SamplingBatch,
        draft_probs: Tensor | None = None,
        on_device: bool = False,
    ) -> RejectionOutput:
        """target_logits [sum(k_i + 1), V]; draft_token_ids [sum(k_i)] (on the host or the
        logits' device); sampling: one row per request (``seeds`` keyed by request index, with
        the output index of the request's first scored position); draft_probs [sum(k_i), V] or
        None. An all-greedy batch's output is on the host unless ``on_device``."""
        if any(k < 0 for k in num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        device = target_logits.device
        num_rows = sum(num_draft_tokens) + len(num_draft_tokens)
        if target_logits.shape[0] != num_rows:
            raise ValueError(
                f"target_logits has {target_logits.shape[0]} rows; {num_draft_tokens} drafts "
                f"need {num_rows} (k_i + 1 per request)"
            )
        if draft_token_ids.shape != (sum(num_draft_tokens),):
            raise ValueError(
                f"draft_token_ids has shape {tuple(draft_token_ids.shape)}, expected "
                f"({sum(num_draft_tokens)},)"
            )
        if draft_probs is not None and draft_probs.shape != (
            sum(num_draft_tokens),
            target_logits.shape[1],
        ):
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                f"({sum(num_draft_tokens)}, {target_logits.shape[1]})"
            )
        if sampling.processors:
            raise ValueError(
                "logits processors depend on the tokens before each position: apply them to "
                "target_logits per position before rejection sampling"
            )
        if sampling.all_greedy and not on_device:
            greedy = greedy_ids(self._argmax_rows, target_logits).cpu()
            return _greedy_on_host(greedy, draft_token_ids.cpu(), num_draft_tokens)
        draft_token_ids = draft_token_ids.to(device, non_blocking=True)
        layout = _Layout.build(num_draft_tokens, device)
        drafts = torch.where(layout.valid, draft_token_ids[layout.draft_index], -1)
        greedy_tokens = greedy_ids(self._argmax_rows, target_logits)[
            layout.target_index
        ]  # [B, K + 1]
        greedy_out = _emit(drafts, drafts == greedy_tokens[:, :-1], layout, greedy_tokens)
        if sampling.all_greedy:
            return greedy_out
        sampled_out = self._sample(
            target_logits, drafts, draft_probs, sampling, layout, num_draft_tokens
        )
        greedy_rows = (sampling.temperature < _GREEDY_EPS).unsqueeze(1)
        return RejectionOutput(
            torch.where(greedy_rows, greedy_out.token_ids, sampled_out.token_ids),
            torch.where(greedy_rows[:, 0], greedy_out.num_accepted, sampled_out.num_accepted),
        )

    def _sample(
        self,
        target_logits: Tensor,
        drafts: Tensor,
        draft_probs: Tensor | None,
        sampling: SamplingBatch,
        layout: _Layout,
        num_draft_tokens: list[int],
    ) -> RejectionOutput:
        probs = target_probs(target_logits, sampling, layout.row_request)  # [R, V]
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        uniforms = None
        if draft_probs is not None:
            uniforms = torch.rand(layout.valid.shape, generator=self.generator, device=probs.device)
        if sampling.seeds:
            self._seeded_draws(noise, uniforms, sampling.seeds, num_draft_tokens)
        if draft_probs is None:
            # Every scored row's token is its race's winner, the plain sampler's token there; a
            # draft is accepted when it is that token (the module's docstring).
            tokens = probs.div(noise).max(dim=-1).indices[layout.target_index]  # [B, K + 1]
            return _emit(drafts, drafts == tokens[:, :-1], layout, tokens)
        safe_drafts = drafts.clamp(min=0)
        draft_rows = layout.target_index[:, :-1]  # [B, K]
        p = probs[draft_rows]  # [B, K, V]
        p_draft = p.gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
        q = draft_probs.float()[layout.draft_index]
        q_draft = q.gather(2, safe_drafts.unsqueeze(2)).squeeze(2)
        residual = (p - q).clamp(min=0.0)
        # p == q leaves nothing; a rejection then has probability 0, but rounding can still
        # reach it: fall back to p rather than to an arbitrary token.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        # Exponential race: argmax(w / E) with E ~ Exp(1) samples proportionally to w.
        recovered = residual.div(noise[draft_rows]).max(dim=-1).indices  # [B, K]
        bonus_rows = layout.target_index[:, -1]
        bonus = probs[bonus_rows].div(noise[bonus_rows]).max(dim=-1).indices  # [B]
        # Position j's token if the run stops there: recovered for a draft position, the bonus
        # token at position k_i.
        final = torch.cat([recovered, bonus.unsqueeze(1)], dim=1)
        final = final.scatter(1, layout.num_draft.unsqueeze(1), bonus.unsqueeze(1))
        accepted = uniforms * q_draft < p_draft
        return _emit(drafts, accepted, layout, final)

    def _seeded_draws(
        self,
        noise: Tensor,
        uniforms: Tensor | None,
        seeds: dict[int, tuple[int, int]],
        num_draft_tokens: list[int],
    ) -> None:
        """Overwrite the seeded requests' draws: at each scored position, the noise over the
        vocabulary, then (with draft probabilities, at a draft's position) the acceptance uniform,
        from a generator seeded by (seed, output index). Rows are laid out from the host's counts:
        nothing is read back from the device."""
        first_row = 0
        first_rows = []
        for k in num_draft_tokens:
            first_rows.append(first_row)
            first_row += k + 1
        for request, (seed, index) in seeds.items():
            k = num_draft_tokens[request]
            for j in range(k + 1):
                generator = at_position(self._seeded, seed, index + j)
                noise[first_rows[request] + j].exponential_(generator=generator)
                if uniforms is not None and j < k:
                    uniforms[request, j : j + 1].uniform_(generator=generator)


def _greedy_on_host(
    greedy: Tensor, draft_token_ids: Tensor, num_draft_tokens: list[int]
) -> RejectionOutput:
    """Per request, its drafts up to the first that differs from the target's argmax at its
    position, then the argmax there (``greedy`` [sum(k_i + 1)] and the drafts on the host)."""
    targets, drafts = greedy.tolist(), draft_token_ids.tolist()
    width = max(num_draft_tokens, default=0) + 1
    rows, counts = [], []
    row = draft = 0
    for k in num_draft_tokens:
        accepted = 0
        while accepted < k and drafts[draft + accepted] == targets[row + accepted]:
            accepted += 1
        out = drafts[draft : draft + accepted] + [targets[row + accepted]]
        rows.append(out + [PLACEHOLDER_TOKEN_ID] * (width - len(out)))
        counts.append(accepted)
        row += k + 1
        draft += k
    return RejectionOutput(
        torch.tensor(rows, dtype=torch.int64).view(len(num_draft_tokens), width),
        torch.tensor(counts, dtype=torch.int64),
    )


def _emit(drafts: Tensor, accepted: Tensor, layout: _Layout, final: Tensor) -> RejectionOutput:
    """Output rows from per-position acceptance [B, K] and the token at the first rejection (or
    the bonus) per position [B, K + 1]."""
    run = torch.cumprod((accepted & layout.valid).to(torch.int64), dim=1)
    num_accepted = run.sum(dim=1)  # [B]
    j = torch.arange(final.shape[1], device=final.device).unsqueeze(0)
    padded_drafts = torch.cat([drafts, drafts.new_full((drafts.shape[0], 1), -1)], dim=1)
    stop = num_accepted.unsqueeze(1)
    tokens = torch.where(j < stop, padded_drafts, final)
    tokens = torch.where(j > stop, PLACEHOLDER_TOKEN_ID, tokens)
    return RejectionOutput(tokens, num_accepted)
