"""Token embeddings and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)  # [T, hidden]


class LMHead(VocabEmbedding):
    """Hidden states to logits; ``tie(embedding)`` shares the embedding's weight. A platform may set
    ``kernel`` after loading to compute the product its own way (as ``Linear.kernel``)."""

    kernel: Callable[[Tensor], Tensor] | None = None

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: Tensor) -> Tensor:
        if self.kernel is not None:
            return self.kernel(hidden)
        return F.linear(hidden, self.weight)  # [N, vocab]
