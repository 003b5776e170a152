"""Mixtures of tokenized directories (``data.sources``): the weights hold, the stream is a pure
function of the seed (whichever rows a process reads), a source that runs out reshuffles and goes
on, the iterator resumes from its state with the tokens seen per source, and the errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import write_bpe_tokenizer, write_text_corpus

from jaxpar.config import ConfigError, load_config, to_yaml, validate
from jaxpar.data import DataIterator, open_mixture
from jaxpar.data.mixture import BLOCK, block_counts, permute, source_names
from jaxpar.data.pretokenize import TokenizeOptions, tokenize

SEQ_LEN = 32


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, Path]:
    """Two byte-tokenized directories of different sizes (a: 30 documents, b: 60)."""
    root = tmp_path_factory.mktemp("mix")
    for name, documents, seed in (("a", 30, 0), ("b", 60, 1)):
        write_text_corpus(root / f"text-{name}", documents=documents, seed=seed)
        tokenize(TokenizeOptions(sources=(str(root / f"text-{name}"),), directory=root / name,
                                 shard_tokens=1000))
    return root / "a", root / "b"


def _mix(two, weights=(3.0, 1.0), seed=0, shuffle=True):
    return open_mixture(list(zip(map(str, two), weights, strict=True)), SEQ_LEN,
                        tokenizer="byte", seed=seed, shuffle=shuffle)


def test_block_counts_round_by_largest_remainder():
    assert block_counts([3, 1]).tolist() == [3072, 1024]
    assert block_counts([1, 1, 1]).tolist() == [1366, 1365, 1365]  # ties: the earlier source
    assert block_counts([0.5, 0.3, 0.2], block=10).tolist() == [5, 3, 2]
    assert block_counts([2, 1], block=10).tolist() == [7, 3]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 100, 1000, 4097])
def test_permute_is_a_permutation_chosen_by_its_key(n):
    order = permute(np.arange(n), n, (0, 1, 2))
    assert sorted(order.tolist()) == list(range(n))
    np.testing.assert_array_equal(order, permute(np.arange(n), n, (0, 1, 2)))
    if n >= 100:
        assert not np.array_equal(order, permute(np.arange(n), n, (0, 1, 3)))
        assert not np.array_equal(order, np.arange(n))


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_block_holds_the_weights_share_of_rows(two, shuffle):
    mix = _mix(two, (3.0, 1.0), shuffle=shuffle)
    sources, _ = mix.locate(np.arange(3 * BLOCK))
    assert np.bincount(sources).tolist() == [3 * 3072, 3 * 1024]
    # Any window is close too: within one block's rounding of its share.
    window = np.bincount(sources[1000:1512], minlength=2)
    assert abs(window[0] / 512 - 0.75) < 0.08, window


def test_the_stream_is_a_function_of_the_seed(two):
    rows = np.arange(5000, 5064)
    a, b = _mix(two).rows(rows), _mix(two).rows(rows)
    for key in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["inputs"], _mix(two, seed=1).rows(rows)["inputs"])


def test_rows_are_the_sources_rows(two):
    mix = _mix(two)
    indices = np.arange(700, 900)
    sources, rows = mix.locate(indices)
    got = mix.rows(indices)
    for s, ds in enumerate(mix.datasets):
        at = sources == s
        np.testing.assert_array_equal(got["inputs"][at], ds.rows(rows[at])["inputs"])
        np.testing.assert_array_equal(mix.segment_ids(indices)[at], ds.segment_ids(rows[at]))


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_source_that_runs_out_reshuffles_and_goes_on(two, shuffle):
    mix = _mix(two, (1.0, 1.0), shuffle=shuffle)
    sources, rows = mix.locate(np.arange(4 * BLOCK))
    for s, ds in enumerate(mix.datasets):
        drawn = rows[sources == s]  # source s's rows in the order the mixture draws them
        epochs = drawn[: len(drawn) // len(ds) * len(ds)].reshape(-1, len(ds))
        assert len(epochs) >= 3
        for epoch in epochs:  # every row once per epoch
            assert sorted(epoch.tolist()) == list(range(len(ds)))
        if shuffle:  # in a new order each epoch
            assert not np.array_equal(epochs[0], epochs[1])
        else:
            np.testing.assert_array_equal(epochs[0], np.arange(len(ds)))


def test_tokens_counted_from_row_numbers_are_the_masks_sums(two):
    mix = _mix(two)
    indices = np.arange(3 * BLOCK)  # every row of both sources, the padded last ones included
    sources, _ = mix.locate(indices)
    mask = mix.rows(indices)["mask"].sum(axis=1)
    expected = [int(mask[sources == s].sum()) for s in range(2)]
    assert mix.count_tokens(indices).tolist() == expected
    assert expected[0] < np.sum(sources == 0) * SEQ_LEN  # some padding was drawn


def test_processes_see_one_stream_and_one_count(two):
    full = DataIterator(_mix(two), 8, seed=0, shuffle=False)
    halves = [full.with_rows(np.array([0, 2, 4, 6])), full.with_rows(np.array([7, 5, 3, 1]))]
    for _ in range(3):
        batch = next(full)
        parts = [next(h) for h in halves]
        np.testing.assert_array_equal(parts[0]["inputs"], batch["inputs"][[0, 2, 4, 6]])
        np.testing.assert_array_equal(parts[1]["inputs"], batch["inputs"][[7, 5, 3, 1]])
    seen = full.tokens_seen()
    assert seen == halves[0].tokens_seen() == halves[1].tokens_seen()
    assert set(seen) == {"a", "b"} and sum(seen.values()) > 0


def test_resume_gives_the_same_batches_and_counts(two):
    it = DataIterator(_mix(two), 8, seed=0, shuffle=False)
    for _ in range(2):
        next(it)
    state = it.get_state()
    assert state["tokens_seen"] == it.tokens_seen()
    expected = [next(it)["inputs"] for _ in range(3)]
    resumed = DataIterator(_mix(two), 8, seed=0, shuffle=False, rows=np.array([1, 3]))
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["inputs"], want[[1, 3]])
    assert resumed.tokens_seen() == it.tokens_seen()


def test_source_names_are_directory_names_made_unique():
    assert source_names(["data/web", "/x/code/"]) == ("web", "code")
    assert source_names(["a/web", "b/web", "c"]) == ("web-0", "web-1", "c")


def test_a_weight_too_small_to_draw_is_an_error(two):
    with pytest.raises(ValueError, match=r"data.sources\[1\].weight=0.0001 is under 1/4096"):
        _mix(two, (1.0, 0.0001))


def test_a_path_that_is_not_tokenized_is_an_error(two, tmp_path):
    with pytest.raises(ValueError, match=r"data.sources\[1\].path=.* not a directory written by "
                       "jaxpar tokenize"):
        open_mixture([(str(two[0]), 1.0), (str(tmp_path), 1.0)], SEQ_LEN, tokenizer="byte",
                     seed=0)


def test_sources_of_another_tokenizer_are_an_error(two, tmp_path):
    pytest.importorskip("tokenizers")
    texts = write_text_corpus(tmp_path / "text", documents=20)
    tokenizer = write_bpe_tokenizer(tmp_path / "tokenizer.json", list(texts.values()))
    tokenize(TokenizeOptions(sources=(str(tmp_path / "text"),), directory=tmp_path / "bpe",
                             tokenizer=str(tokenizer)))
    with pytest.raises(ValueError, match=r"data.sources\[1\].path=.* was tokenized with "
                       r".*tokenizer.json but data.sources\[0\].path=.* with byte"):
        open_mixture([(str(two[0]), 1.0), (str(tmp_path / "bpe"), 1.0)], SEQ_LEN,
                     tokenizer="byte", seed=0)
    with pytest.raises(ValueError, match=r"data.tokenizer='byte' is not the tokenizer "
                       r"data.sources\[0\].path="):
        open_mixture([(str(tmp_path / "bpe"), 1.0)], SEQ_LEN, tokenizer="byte", seed=0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.sources=[{path: a, weight: 0}]"], r"data.sources\[0\].weight=0.0: must be a finite"),
    (["data.sources=[{path: a}, {path: b, weight: -1}]"], r"data.sources\[1\].weight=-1.0"),
    (["data.sources=[{path: a}]", "data.source=corpus"],
     "data.source=corpus and data.sources are both set"),
    (["data.sources=[{weight: 1}]"], r"data.sources\[0\].path is empty"),
    (["data.sources=a"], "data.sources: expected a list of mappings with keys path, weight"),
    (["data.sources=[{path: a, wieght: 1}]"], r"unknown key data.sources\[0\].wieght"),
    (["data.sources=[a]"], r"data.sources\[0\]: expected a mapping"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("tiny", overrides), 8)


def test_sources_in_config_files_and_back(tmp_path):
    cfg = load_config("tiny", ["data.sources=[{path: d/a, weight: 3}, {path: d/b}]"])
    assert [(s.path, s.weight) for s in cfg.data.sources] == [("d/a", 3.0), ("d/b", 1.0)]
    (tmp_path / "run.yaml").write_text(to_yaml(cfg))
    assert load_config(str(tmp_path / "run.yaml")) == cfg
    assert load_config("tiny").data.sources == ()
    validate(cfg, 8)  # data.source stays at its default: no conflict
