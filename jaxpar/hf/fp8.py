"""Block-scaled float8 weights (DeepSeek-V3's), read as float32 a block of rows at a time.

``NAME.weight`` [out, in] is float8 e4m3 beside a float32 ``NAME.weight_scale_inv`` [ceil(out / b0),
ceil(in / b1)], ``weight_block_size`` [b0, b1]. The weight is ``w8 * scale_inv``, each scale
broadcast over its block. safetensors' numpy reader refuses float8, so rows are mapped from the
file's own layout and converted with ``ml_dtypes`` (docs/hugging-face.md, "DeepSeek-V3").
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np

SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F32": np.float32, "BF16": ml_dtypes.bfloat16,
          "F16": np.float16}


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def _header(file: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and where its data begin (cached per version)."""
    stat = Path(file).stat()
    return _read_header(str(file), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=64)
def _read_header(file: str, _mtime: int, _size: int) -> tuple[dict, int]:
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def tensor_info(file: Path, name: str) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype name, shape) of tensor ``name`` in ``file``."""
    entry = _header(file)[0][name]
    return entry["dtype"], tuple(entry["shape"])


def read_rows(file: Path, name: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of tensor ``name`` in its stored dtype: a copy, the mapping released."""
    header, data = _header(file)
    entry = header[name]
    dtype, shape = np.dtype(DTYPES[entry["dtype"]]), tuple(entry["shape"])
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    count = (stop - start) * row_bytes
    if count == 0:
        return np.empty((0, *shape[1:]), dtype)
    mapped = np.memmap(file, np.uint8, "r", offset=data + entry["data_offsets"][0]
                       + start * row_bytes, shape=(count,))
    rows = np.array(mapped.view(dtype).reshape(stop - start, *shape[1:]))
    del mapped
    return rows


def dequantized_rows(file: Path, scale_file: Path, name: str, start: int, stop: int,
                     block: tuple[int, int]) -> np.ndarray:
    """Rows ``start:stop`` of float8 weight ``name`` as float32, each times its block's
    ``scale_inv``.
    """
    w = read_rows(file, name, start, stop).astype(np.float32)
    first, last = start // block[0], (stop - 1) // block[0] + 1
    scales = read_rows(scale_file, scale_name(name), first, last).astype(np.float32)
    per_row = np.repeat(scales, block[0], axis=0)[start - first * block[0]:][:stop - start]
    return w * np.repeat(per_row, block[1], axis=1)[:, :w.shape[1]]
