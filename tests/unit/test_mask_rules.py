"""Document masks (``data.document_mask``): the mask description's rules on the host, the
config key, and the implementation that cannot express documents. The kernels and the models
on packed rows are in tests/equivalence/test_document_mask.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpar.config import ConfigError, documents_masked, load_config
from jaxpar.model.fused import resolve
from jaxpar.model.mask import FULL, MASKED, SKIP, AttentionMask, block_kind, document_positions


def test_document_positions_restart_at_each_document():
    segments = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8])
    np.testing.assert_array_equal(document_positions(segments),
                                  [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))])


def block(order: list[int], segments: list[int] | None) -> AttentionMask:
    return AttentionMask(np.array([order]), None if segments is None else np.array([segments]))


@pytest.mark.parametrize("q,k,kind", [
    (block([4, 5], [1, 1]), block([0, 1], [1, 1]), FULL),  # before, one document
    (block([4, 5], [1, 1]), block([0, 1], [0, 0]), SKIP),  # before, an earlier document
    (block([4, 5], [1, 2]), block([2, 3], [1, 1]), MASKED),  # a boundary in the queries
    (block([4, 5], [1, 1]), block([2, 3], [0, 1]), MASKED),  # a boundary in the keys
    (block([0, 1], [0, 0]), block([4, 5], [0, 0]), SKIP),  # after
    (block([2, 3], [0, 0]), block([2, 3], [0, 0]), MASKED),  # the diagonal
    (block([4, 5], None), block([0, 1], None), FULL),  # no documents: causal only
])
def test_block_kinds_with_documents(q, k, kind):
    assert int(block_kind(q, k)) == kind


def test_a_tile_is_skipped_only_when_every_row_is():
    q = AttentionMask(np.array([[4, 5], [4, 5]]), np.array([[1, 1], [0, 0]]))
    k = AttentionMask(np.array([[0, 1], [0, 1]]), np.array([[0, 0], [0, 0]]))
    assert int(block_kind(q, k)) == MASKED  # row 0 skips, row 1 is one document: computed


def test_document_mask_defaults_to_tokenized_sources(tmp_path):
    assert not documents_masked(load_config("tiny", []))  # the stdlib corpus, in memory
    (tmp_path / "index.json").write_text("{}")
    assert documents_masked(load_config("tiny", [f"data.source={tmp_path}"]))
    assert not documents_masked(load_config("tiny", [f"data.source={tmp_path}",
                                                     "data.document_mask=false"]))
    assert documents_masked(load_config("tiny", ["data.document_mask=true"]))


def test_cudnn_cannot_mask_documents():
    assert resolve("auto", "gpu", 4096, 512, "bfloat16", documents=True) == "blockwise"
    with pytest.raises(ConfigError, match="model.attention=cudnn with data.document_mask=true"):
        resolve("cudnn", "gpu", 4096, 512, "bfloat16", documents=True)
