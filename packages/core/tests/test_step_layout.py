"""The runner's host-side facts about a step's layout that attention backends read."""

from __future__ import annotations

import numpy as np
import pytest

from kvik.worker.model_runner import leading_decodes


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([1, 1, 1], 3),  # a decode step
        ([1, 1, 7, 1, 3], 2),  # decodes, a prompt chunk, a decode after it
        ([12, 1, 1], 0),  # a chunk first
        ([], 0),
    ],
)
def test_leading_decodes(rows: list[int], expected: int) -> None:
    assert leading_decodes(np.array(rows, dtype=np.int64)) == expected
