"""The seam between the model runner and a proposer of speculative decoding's draft tokens.

After every step the runner hands the proposer the step (its scheduled requests, prepared inputs
and the tokens each sampling request got) and the number of drafts each request may receive; the
proposer returns the drafts, which the scheduler schedules in the request's next step. A proposer
that needs more of the target than its tokens runs the target's forward itself (``run_target``:
EAGLE-3 reads hidden states of three layers); one with a KV cache of its own (a draft model)
sizes it with the target's blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from kvik.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    from kvik.scheduler.output import SchedulerOutput
    from kvik.spec_decode.rejection_sampler import RejectionOutput
    from kvik.worker.model_runner import ModelRunner
    from kvik.worker.step_io import StepInputs


class Proposer:
    """Proposes nothing by itself: the base of the runner's proposers."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of the proposer's own KV cache per block of the target's."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The target's cache has ``num_blocks`` blocks (0: dropped after profiling)."""

    def drop(self, request_id: str) -> None:
        """The request finished: forget what the proposer keeps for it."""

    def run_target(self, inputs: StepInputs) -> tuple[Tensor | None, Tensor | None]:
        """The target's forward for the step, as the step runner runs it."""
        return self.runner.step_runner.forward(inputs)

    #: True: ``launch`` starts each proposal from the step's tokens on the device, before the
    #: host reads them back, and ``propose`` finishes it.
    proposes_on_device = False

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        verified: RejectionOutput | None,
        caps: dict[str, int],
    ) -> object:
        """Start the proposal on the device from the step's tokens there (``verified``: a row
        per sampling request; None when none samples), for the requests in ``caps`` (upper
        bounds: the true caps are known after the read-back). Returns what ``propose`` takes
        as ``launched``."""
        raise NotImplementedError

    def propose(
        self,
        scheduler_output: SchedulerOutput,
        inputs: StepInputs,
        new_tokens: dict[str, list[int]],
        caps: dict[str, int],
        launched: object = None,
    ) -> dict[str, list[int]]:
        """Drafts for the requests in ``caps`` (at most ``caps[id]`` each; none is fine), given
        the tokens each sampling request got in this step (not yet in ``all_token_ids``);
        ``launched``: what this step's ``launch`` returned, if the proposer launches."""
        raise NotImplementedError


class NgramDraftProposer(Proposer):
    """Prompt lookup over each request's own tokens (kvik.spec_decode.ngram_proposer)."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.ngram = NgramProposer.from_config(runner.config.speculative)

    def propose(self, scheduler_output, inputs, new_tokens, caps, launched=None):
        drafts = {}
        for request in inputs.sampling_requests:
            cap = caps.get(request.request_id)
            if not cap:
                continue
            sequence = np.array(request.all_token_ids + new_tokens[request.request_id])
            proposal = self.ngram.propose_one(sequence, cap)
            if proposal.size:
                drafts[request.request_id] = proposal.tolist()
        return drafts


def make_proposer(runner: ModelRunner) -> Proposer:
    """The proposer of the engine's speculative config (loading a draft model or a head)."""
    method = runner.config.speculative.method
    if method == "ngram":
        return NgramDraftProposer(runner)
    if method == "draft_model":
        from kvik.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(runner)
    if method == "eagle3":
        from kvik.spec_decode.eagle3_proposer import Eagle3Proposer

        return Eagle3Proposer(runner)
    raise ValueError(f"no proposer for speculative method {method!r}")
