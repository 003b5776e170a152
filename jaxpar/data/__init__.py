"""Data pipeline: tokenizers, corpus sources, packing into rows, tokenized corpora on disk, and
the per-process iterator.

>>> tok = make_tokenizer("byte")
>>> ds = build_dataset("stdlib", tok, seq_len=256)
>>> it = DataIterator(ds, global_batch=32, seed=0)  # rows=: this process's rows only
>>> batch = next(it)  # {"inputs", "targets", "mask"}: numpy arrays of shape [32, 256]

``jaxpar tokenize`` writes a corpus once as shards (:mod:`.shards`); :func:`open_tokenized`
reads a split as rows, :func:`open_mixture` several by weight, :func:`open_source` whichever
``data.source`` names. Importing does not import jax; :class:`DataIterator` (grain, which
does) is imported on first use.
"""

from typing import TYPE_CHECKING

from jaxpar.data.dataset import build_dataset, check_vocabulary, dataset_line, open_source
from jaxpar.data.mixture import MixtureDataset, open_mixture
from jaxpar.data.packing import PackedDataset
from jaxpar.data.shards import is_tokenized
from jaxpar.data.split_rows import TokenizedDataset, open_tokenized
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer

if TYPE_CHECKING:
    from jaxpar.data.loader import DataIterator

__all__ = [
    "ByteTokenizer",
    "DataIterator",
    "HFTokenizer",
    "MixtureDataset",
    "PackedDataset",
    "TokenizedDataset",
    "Tokenizer",
    "build_dataset",
    "check_vocabulary",
    "dataset_line",
    "is_tokenized",
    "make_tokenizer",
    "open_mixture",
    "open_source",
    "open_tokenized",
]


def __getattr__(name: str) -> type:
    if name == "DataIterator":
        from jaxpar.data.loader import DataIterator  # noqa: PLC0415  (grain, hence jax)

        return DataIterator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
