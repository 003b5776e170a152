"""Data pipeline: tokenizers, corpus sources, packing into rows, and the per-process iterator.

>>> tok = make_tokenizer("byte")
>>> ds = build_dataset("stdlib", tok, seq_len=256)
>>> it = DataIterator(ds, global_batch=32, seed=0)  # rows=: this process's rows only
>>> batch = next(it)  # {"inputs", "targets", "mask"}: numpy arrays of shape [32, 256]
"""

from jaxpar.data.dataset import build_dataset, dataset_line
from jaxpar.data.loader import DataIterator
from jaxpar.data.packing import PackedDataset
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataIterator",
    "HFTokenizer",
    "PackedDataset",
    "Tokenizer",
    "build_dataset",
    "dataset_line",
    "make_tokenizer",
]
