"""Document masking (``data.document_mask``): attention never crosses a document boundary and
rotary positions restart at each document, in every attention implementation.

The kernels against jax's own attention with an explicit mask; the block counts of the blockwise
and ring kernels on a row of known documents (compiled flops cannot see a data-dependent skip);
and the proof on whole models: a packed row of several documents gives the same loss and
gradients as each document run alone (float32, 1e-5), on one device (dense, blockwise), on
``context=4`` (ring, all-gather, Ulysses and the 2 x 2 hybrid, zigzag) and on
``pipe=2 context=2 tensor=2``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_relative_error, random_qkv, trainer_for
from jax.sharding import PartitionSpec as P

from jaxpar.model.attention import (
    blockwise_attention,
    dense_attention,
    empty_statistics,
    fold_keys,
    group,
)
from jaxpar.model.fused import splash_attention
from jaxpar.model.mask import AttentionMask, document_positions
from jaxpar.parallel.context import ring_forward, zigzag_order

B, D = 2, 16


def segments_of(lengths: list[int]) -> np.ndarray:
    """Document ids of a row of documents of ``lengths``, laid end to end."""
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


def qkv(heads: int, kv_heads: int, seq: int):
    return random_qkv(heads, kv_heads, seq, B, D)


def reference(q, k, v, segments):
    """jax's attention with the mask written out: causal and within documents (storage order)."""
    s = segments.shape[-1]
    allowed = np.tril(np.ones((s, s), bool)) & (segments[:, :, None] == segments[:, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(allowed)[:, None],
                                        implementation="xla")


def row_masks(rows: list[list[int]], order: np.ndarray) -> tuple[AttentionMask, np.ndarray]:
    """The mask description of rows of documents stored in ``order``, and the segments in
    storage (row) order."""
    segments = np.stack([segments_of(r) for r in rows])
    mask = AttentionMask(jnp.asarray(np.broadcast_to(order, segments.shape), jnp.int32),
                         jnp.asarray(segments[:, order]),
                         jnp.asarray(document_positions(segments)[:, order]))
    return mask, segments


def assert_same(ours, theirs, q, k, v, grad_tol: float) -> None:
    """Outputs and the gradients of a random projection of them agree."""
    weights = jax.random.normal(jax.random.key(1), q.shape)

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * weights), argnums=(0, 1, 2))(q, k, v)

    np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), atol=2e-6, rtol=1e-5)
    for got, want in zip(grads(ours), grads(theirs), strict=True):
        np.testing.assert_allclose(got, want, atol=grad_tol, rtol=10 * grad_tol)


ROWS = [[10, 20, 2, 32], [64]]  # a row of four documents and one of a single document


@pytest.mark.parametrize("impl,block,zigzag", [("dense", None, False), ("blockwise", 8, False),
                                               ("blockwise", 16, True)])
def test_kernels_keep_inside_documents(impl, block, zigzag):
    """Output and gradients against the written-out mask, in order and out of order."""
    q, k, v = qkv(8, 2, 64)
    order = zigzag_order(64, 2) if zigzag else np.arange(64)
    mask, segments = row_masks(ROWS, order)
    attend = dense_attention if impl == "dense" else blockwise_attention(block)

    inverse = np.argsort(order)

    def theirs(q, k, v):  # in storage order, scattered back to ``order``
        return reference(q[:, inverse], k[:, inverse], v[:, inverse], segments)[:, order]

    assert_same(lambda q, k, v: attend(q, k, v, mask), theirs,
                *(x[:, order] for x in (q, k, v)), grad_tol=5e-6)


def test_splash_kernel_keeps_inside_documents():
    """The TPU kernel with its SegmentIds, in Pallas' interpreter on the CPU."""
    q, k, v = qkv(4, 2, 256)
    mask, segments = row_masks([[100, 28, 128], [256]], np.arange(256))
    attend = splash_attention(128, interpret=True)
    assert_same(lambda q, k, v: attend(q, k, v, mask),
                lambda q, k, v: reference(q, k, v, segments), q, k, v, grad_tol=1e-5)


# --------------------------------------------------------------------------------------------
# Blocks computed


DOCS = [64, 64, 128]  # one row of 256 tokens; blocks of 32: documents of 2, 2 and 4 blocks
# Causal within documents: 3 + 3 + 10 block pairs (the block diagonal of each document's
# triangle), against 8 x 9 / 2 = 36 for one causal sequence.
EXPECTED_BLOCKS, CAUSAL_BLOCKS = 3 + 3 + 10, 36


def test_blockwise_computes_only_the_documents_blocks():
    q, k, v = qkv(4, 2, 256)
    mask, _ = row_masks([DOCS, DOCS], np.arange(256))
    causal = AttentionMask(mask.order)
    qg = group(q, 2)

    def count(m):
        return int(jax.jit(lambda q, k, v: fold_keys(empty_statistics(q), q, k, v, m, m, 32,
                                                     count=True)[1])(qg, k, v))

    assert count(causal) == CAUSAL_BLOCKS
    assert count(mask) == EXPECTED_BLOCKS


def test_ring_computes_only_the_documents_blocks_on_each_device():
    """context=4, zigzag: device i holds chunks i and 7-i (of 32 tokens): of its 2 x 8 (query,
    key) chunk pairs it computes those in one document with keys not after queries."""
    n, seq = 4, 256
    order = zigzag_order(seq, n)
    q, k, v = (x[:, order] for x in qkv(4, 2, seq))
    mask, _ = row_masks([DOCS, DOCS], order)
    mask = AttentionMask(mask.order, mask.segments)
    mesh = jax.make_mesh((n,), ("context",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))

    def counts(m):
        def local(q, k, v, m):
            return ring_forward(group(q, 2), k, v, m, m, n, 32, count=True)[2][None]
        seq4 = P(None, "context", None, None)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(seq4, seq4, seq4, P(None, "context")),
                           out_specs=P("context"))
        return np.asarray(jax.jit(fn)(q, k, v, m)).tolist()

    assert counts(AttentionMask(mask.order)) == [9, 9, 9, 9]  # zigzag's even causal split
    # chunks of DOCS: 0-1, 2-3, 4-7. Device 0: chunk 0 sees 0, chunk 7 sees 4..7; device 1:
    # 1 sees 0-1, 6 sees 4-6; device 2: 2 sees 2, 5 sees 4-5; device 3: 3 sees 2-3, 4 sees 4.
    assert counts(mask) == [1 + 4, 2 + 3, 1 + 2, 2 + 1]
    assert sum(counts(mask)) == EXPECTED_BLOCKS


# --------------------------------------------------------------------------------------------
# Whole models: packed rows against each document alone

SEQ = 32
PACKED = [[5, 11, 16], [32], [7, 7, 7, 11], [20, 12]]  # four rows of 32 tokens, ten documents
BASE = ["train.batch_size=4", f"train.seq_len={SEQ}", "data.document_mask=true"]


def documents(vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) of each document of PACKED, random, in row order. Each token's target
    is its own (in a real stream the next token, the separator at the end): so a document has
    the same targets packed and alone, by construction."""
    rng = np.random.default_rng(7)
    return [(rng.integers(0, vocab, n, dtype=np.int32), rng.integers(0, vocab, n, dtype=np.int32))
            for row in PACKED for n in row]


def rows_of(docs: list[tuple[np.ndarray, np.ndarray]], rows: list[list[int]], batch: int
            ) -> dict[str, np.ndarray]:
    """A host batch of ``batch`` rows: row r holds documents ``rows[r]`` (indices into
    ``docs``) end to end, then padding (one more segment, mask 0)."""
    out = {"inputs": np.zeros((batch, SEQ), np.int32), "targets": np.zeros((batch, SEQ), np.int32),
           "mask": np.zeros((batch, SEQ), np.float32),
           "segment_ids": np.zeros((batch, SEQ), np.int32)}
    for r, ids in enumerate(rows):
        at = 0
        for seg, i in enumerate(ids):
            inputs, targets = docs[i]
            n = len(inputs)
            out["inputs"][r, at:at + n], out["targets"][r, at:at + n] = inputs, targets
            out["mask"][r, at:at + n], out["segment_ids"][r, at:at + n] = 1.0, seg
            at += n
        out["segment_ids"][r, at:] = len(ids)
    return out


def packed_and_alone(vocab: int) -> tuple[dict, list[dict]]:
    """The packed batch, and batches holding one document a row (ten documents, three
    batches of four rows, the last two rows of the last empty)."""
    docs, first = documents(vocab), np.cumsum([0] + [len(r) for r in PACKED])
    packed = rows_of(docs, [list(range(a, b)) for a, b in zip(first[:-1], first[1:],
                                                                strict=True)], 4)
    alone = [rows_of(docs, [[i] for i in range(s, min(s + 4, len(docs)))], 4)
             for s in range(0, len(docs), 4)]
    return packed, alone


def summed_loss_and_grads(trainer, state, host_batch: dict) -> tuple[float, dict]:
    """The summed token loss and its gradient (the step's are divided by the valid tokens)."""
    loss, grads = trainer.loss_and_grads(state, trainer.put_batch(host_batch))
    valid = float(host_batch["mask"].sum()) or 1.0
    return float(loss) * valid, jax.tree.map(lambda g: np.asarray(g, np.float64) * valid, grads)


LAYOUTS = {
    "1 device, dense": (["mesh.data=1", "model.attention=dense"], 1),
    "1 device, blockwise": (["mesh.data=1", "model.attention=blockwise",
                             "model.attention_block=8"], 1),
    "context=4 ring zigzag": (["mesh.data=1", "mesh.context=4"], 4),
    "context=4 allgather zigzag": (["mesh.data=1", "mesh.context=4",
                                    "parallel.context_impl=allgather"], 4),
    "context=4 ulysses zigzag": (["mesh.data=1", "mesh.context=4",
                                  "parallel.context_impl=ulysses"], 4),
    "context=4 hybrid 2x2": (["mesh.data=1", "mesh.context=4", "parallel.context_impl=hybrid",
                              "parallel.ulysses_size=2"], 4),
    "pipe=2 context=2 tensor=2": (["mesh.pipe=2", "mesh.data=1", "mesh.context=2",
                                   "mesh.tensor=2", "train.microbatches=2",
                                   "parallel.pipeline_schedule=1f1b"], 8),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_documents_give_each_documents_loss_and_gradients(layout):
    overrides, devices = LAYOUTS[layout]
    trainer = trainer_for([*BASE, *overrides], devices)
    state = trainer.init()
    packed, alone = packed_and_alone(trainer.cfg.model.vocab_size)
    loss, grads = summed_loss_and_grads(trainer, state, packed)
    pieces = [summed_loss_and_grads(trainer, state, b) for b in alone]
    want_loss = sum(p[0] for p in pieces)
    want_grads = jax.tree.map(lambda *g: sum(g), *(p[1] for p in pieces))
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (loss, want_loss)
    errors = max_relative_error(grads, want_grads)
    assert max(jax.tree.leaves(errors)) <= 1e-5, errors
    # Per document: the packed batch's loss with only that document's targets counted.
    flat = [(r, s) for r, row in enumerate(PACKED) for s in range(len(row))]
    for i, (r, s) in enumerate(flat):
        one = dict(packed, mask=packed["mask"] * ((np.arange(4)[:, None] == r)
                                                  & (packed["segment_ids"] == s)))
        alone_one = alone[i // 4]
        alone_one = dict(alone_one, mask=alone_one["mask"] * (np.arange(4)[:, None] == i % 4))
        got, want = (float(trainer.loss_and_grads(state, trainer.put_batch(b))[0])
                     for b in (one, alone_one))
        assert abs(got - want) <= 1e-5 * abs(want), (i, got, want)
    # Without document ids (one segment a row) the packed rows differ: the test has teeth.
    # (A freshly initialised model's loss hardly depends on the context; its gradients do.)
    _, mixed = summed_loss_and_grads(trainer, state, dict(packed, segment_ids=0 * packed[
        "segment_ids"]))
    assert max(jax.tree.leaves(max_relative_error(mixed, want_grads))) > 1e-2


@pytest.mark.parametrize("layout", ["1 device, dense", "context=4 ring zigzag"])
def test_the_eval_step_masks_documents_as_the_train_step(layout):
    from jaxpar.train.validation_loss import Validation

    trainer = trainer_for([*BASE, *LAYOUTS[layout][0]], LAYOUTS[layout][1])
    state = trainer.init()
    packed, _ = packed_and_alone(trainer.cfg.model.vocab_size)
    validation = Validation(trainer, {"": [packed]}, "")
    validation.compile()
    want = float(trainer.loss_and_grads(state, trainer.put_batch(packed))[0])
    np.testing.assert_allclose(validation.evaluate(state)["val_loss"], want, rtol=1e-6)
