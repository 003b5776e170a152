"""Context parallelism's schedule: the zigzag order and the blocks each device computes (nothing
compiled; the attention itself: ``tests/equivalence/test_context.py``)."""

from __future__ import annotations

import pytest

from jaxpar.model.attention import MASKED, SKIP
from jaxpar.parallel.context import block_schedule, zigzag_order


def test_zigzag_gives_device_i_chunks_i_and_2n_minus_1_minus_i():
    order = zigzag_order(16, 4).reshape(4, 2, 2)  # 8 chunks of 2 tokens
    assert [list(chunks[:, 0] // 2) for chunks in order] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_unmasked_blocks_and_contiguous_does_not(n):
    balanced = (block_schedule(64, n, zigzag=True) != SKIP).sum(axis=(1, 2, 3))
    assert (balanced == balanced[0]).all()  # every device: 2n + 1 half-size blocks
    assert balanced[0] == 2 * n + 1
    contiguous = (block_schedule(64, n, zigzag=False) != SKIP).sum(axis=(1, 2, 3))
    assert list(contiguous) == list(range(1, n + 1))  # the last device does n x the first
    # Only blocks on the diagonal need an elementwise mask; the rest are all-visible.
    kinds = block_schedule(64, n, zigzag=True)
    assert (kinds[:, 1:] != MASKED).all() and (kinds[:, 0] == MASKED).sum() == 2 * n
