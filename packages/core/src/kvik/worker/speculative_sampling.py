"""The sampling half of a step with speculative decoding: the target's logits of each request's
scored positions (its drafts', then the one after them) become its accepted drafts and one token
more, and the proposer drafts the request's next step from them.

Synchronous: the next step's drafts depend on the tokens this one accepted, so the step is read
back here (``PendingStep(output=...)``). A proposer that works from the step's tokens on the device
(``Proposer.proposes_on_device``: EAGLE-3) is launched before that read-back, so that the host's
work for it overlaps the target's forward on the device. Masks (structured outputs), logits
processors and logprobs apply at every scored position, so that each position is what a plain step
would have computed had the drafts before it been sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvik.layers.sampler import logprob_tensors
from kvik.spec_decode.rejection_sampler import RejectionOutput
from kvik.worker.nvtx import nvtx_range
from kvik.worker.step_io import ModelRunnerOutput, PendingStep, StepInputs

if TYPE_CHECKING:
    from kvik.request import Request
    from kvik.scheduler.output import SchedulerOutput
    from kvik.worker.model_runner import ModelRunner


class SpeculativeSampling:
    """The runner's speculative steps (``ModelRunner.speculative``, set when a proposer is)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def step(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        logits: Tensor | None,
        finishers: list[Callable[[ModelRunnerOutput], None]],
    ) -> PendingStep:
        """The step's tokens with speculative decoding (synchronous: the drafts of the next step
        are proposed from the tokens accepted in this one). A step that verifies drafts goes
        through the rejection sampler; one without drafts samples as usual."""
        output = ModelRunnerOutput()
        requests = inputs.sampling_requests
        proposer = self.runner.proposer
        on_device = proposer.proposes_on_device
        verified: RejectionOutput | None = None
        if requests:
            first_rows = self.first_logits_rows(inputs)
            if scheduler_output.grammar_bitmask is not None:
                self.runner.apply_grammar_bitmask(
                    logits, requests, scheduler_output.grammar_bitmask, first_rows
                )
            with nvtx_range("sample", self.runner.nvtx):
                if inputs.has_drafts:
                    verified = self._verify(
                        logits, requests, inputs, first_rows, finishers, on_device
                    )
                else:
                    sampled = self.runner.sample(logits, requests, inputs.sampling, finishers)
                    verified = RejectionOutput(sampled.unsqueeze(1), torch.zeros_like(sampled))
        launched = None
        if on_device:
            if verified is not None:
                # The tokens' read-back goes ahead of the drafts' kernels: the host has them
                # (and finishes the step's outputs) while the device still runs the proposer.
                verified.start_copy()
            # Each request's largest cap (as if it got one token): the true caps, known once the
            # tokens are read back, only cut drafts off.
            with nvtx_range("propose", self.runner.nvtx):
                launched = proposer.launch(
                    scheduler_output, inputs, verified, self._proposal_caps(inputs, None)
                )
        if verified is not None:
            for request, new in zip(requests, verified.to_lists(), strict=True):
                output.sampled_token_ids[request.request_id] = new
        for finish in finishers:
            finish(output)
        with nvtx_range("propose", self.runner.nvtx):
            output.spec_token_ids = proposer.propose(
                scheduler_output,
                inputs,
                output.sampled_token_ids,
                self._proposal_caps(inputs, output.sampled_token_ids),
                launched=launched,
            )
        return PendingStep(output=output)

    @staticmethod
    def first_logits_rows(inputs: StepInputs) -> list[int]:
        """Each sampling request's first row in the step's logits (its k_i + 1 rows follow)."""
        rows, row = [], 0
        for k in inputs.num_draft_tokens:
            rows.append(row)
            row += k + 1
        return rows

    def _verify(
        self,
        logits: Tensor,
        requests: list[Request],
        inputs: StepInputs,
        first_rows: list[int],
        finishers: list[Callable[[ModelRunnerOutput], None]],
        on_device: bool,
    ) -> RejectionOutput:
        """Rejection-sample a step that scored drafts: per request, its accepted drafts and one
        token more (on the device where ``on_device``, else wherever the sampler leaves them). Logits processors (penalties, biases, min-tokens) run at each scored position
        over the history it follows. A request with logprobs gets them at each scored position
        (raw, before processors, as a plain step's), kept for its accepted tokens."""
        batch = inputs.sampling
        wanted = [r.sampling_params.logprobs for r in requests]
        counts = [k + 1 for k in inputs.num_draft_tokens]
        logprob_rows = [i for i, w in enumerate(wanted) if w is not None]
        scored = [(i, j) for i in logprob_rows for j in range(counts[i])]
        raw_logprobs = None
        if scored:
            index = torch.tensor([first_rows[i] + j for i, j in scored])
            index = index.to(logits.device, non_blocking=True)
            raw_logprobs = logits[index].log_softmax(-1)
        for row, processors, output_ids in batch.processors:
            # Scored position j follows the request's output and its first j drafts: each
            # position's processors see that history (as a plain step would, had the drafts
            # been sampled).
            drafted = inputs.draft_token_ids[row]
            for j in range(len(drafted) + 1):
                history = [*output_ids, *drafted[:j]] if j else output_ids
                at = first_rows[row] + j
                for processor in processors:
                    logits[at] = processor(history, logits[at])
        drafts = [t for d in inputs.draft_token_ids for t in d]
        result = self.runner.rejection_sampler(
            logits,
            torch.tensor(drafts, dtype=torch.int64),  # moved to the device only if it samples
            inputs.num_draft_tokens,
            dataclasses.replace(batch, processors=[]),
            on_device=on_device,
        )
        if raw_logprobs is not None:
            # Each scored position's chosen token: the accepted run's, then the placeholder
            # (clamped; those entries are dropped below).
            where = result.token_ids.device
            request_index = torch.tensor([i for i, _ in scored]).to(where, non_blocking=True)
            position = torch.tensor([j for _, j in scored]).to(where, non_blocking=True)
            chosen = result.token_ids[request_index, position].clamp(min=0).to(logits.device)
            tensors = logprob_tensors(raw_logprobs, chosen, [wanted[i] for i, _ in scored])
            num_accepted = result.num_accepted

            def finish(output: ModelRunnerOutput) -> None:
                entries = iter(tensors.to_lists())
                accepted = num_accepted.tolist()
                for i in logprob_rows:
                    mine = [next(entries) for _ in range(counts[i])]
                    output.logprobs[requests[i].request_id] = mine[: accepted[i] + 1]

            finishers.append(finish)
        return result

    def _proposal_caps(
        self, inputs: StepInputs, new_tokens: dict[str, list[int]] | None
    ) -> dict[str, int]:
        """How many drafts each sampling request may get for its next step: up to
        num_speculative_tokens, within its max_tokens and max_model_len (counting this step's
        tokens ``new_tokens``, not appended yet; None: before they are known, each request's
        largest cap, that of one new token); none for anyone when the batch is larger than
        ``disable_by_batch_size``. Every kind of request speculates: a grammar's drafts are cut by
        the scheduler to what it accepts (each scored position has its own mask), logits
        processors and logprobs run at each scored position (``_verify``)."""
        limit = self.runner.config.speculative.disable_by_batch_size
        requests = inputs.sampling_requests
        if limit is not None and len(inputs.query_starts) > limit:
            return {}
        caps = {}
        for request in requests:
            num_new = 1 if new_tokens is None else len(new_tokens[request.request_id])
            num_tokens = request.num_tokens + num_new
            num_output = request.num_output_tokens + num_new
            cap = min(
                self.runner.num_speculative_tokens,
                request.max_tokens - num_output - 1,
                self.runner.max_model_len - num_tokens - 1,
            )
            if cap > 0:
                caps[request.request_id] = cap
        return caps
