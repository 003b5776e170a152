"""What a ``jaxpar tokenize`` run has finished, on disk, so that ``--resume`` goes on from there;
and the run's last steps: the split's correction, then the index.

``progress.json`` is rewritten (atomically) after every finished shard. Besides the finished
shards it records, per split, the stream position before which every document of that split is in
a finished shard (``next_document``): a resumed run reads the sources again from the smallest of
these, tokenizes only the documents not yet in a finished shard, and so writes the same shards
as an uninterrupted run. A shard that was being written when the run stopped exists only under a
temporary name and is written again.

The split is :func:`jaxpar.data.dataset.validation_mask`'s, decided one document at a time
(its key's score below ``val_fraction``); the mask's correction (with two or more documents and
``val_fraction > 0`` neither split stays empty: the lowest-scoring document goes to validation,
or the highest-scoring one to train) can only be known at the end, so the run keeps track of
those two documents and moves one of them when it finishes (:func:`_move_document`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.data.shards import (
    INDEX_FILE,
    PROGRESS_FILE,
    SPLIT_NAMES,
    Shard,
    ShardWriter,
    TokenIndex,
    has_index,
    open_memmaps,
    read_index,
    rename_shard,
    write_json_atomically,
)

# (split score, stream position, index within its split) of one document
Extreme = tuple[float, int, int]
# What finish() may delete: shard files no record names, and temporaries (never progress.json
# itself before the index is written: it is the only record of the finished shards).
_STRAY_FILE = re.compile(r"^((train|validation)-\d{5}\.(bin|offsets)(\.tmp)?|progress\.json\.tmp)$")


@dataclasses.dataclass(frozen=True)
class RunState:
    settings: TokenIndex  # the run's options (its splits empty); a resume must repeat them
    shards: dict[str, tuple[Shard, ...]]  # finished shards per split, in stream order
    next_document: dict[str, int]  # per split: its documents before this position are done
    lowest_train: Extreme | None = None  # the train document that would go to validation
    highest_validation: Extreme | None = None  # the validation document that would go to train
    documents: int = 0  # documents in the whole stream (known once complete)
    complete: bool = False  # every document is in a finished shard
    rebalanced: bool = False  # the correction of the split is done

    @classmethod
    def fresh(cls, settings: TokenIndex) -> RunState:
        return cls(settings=settings, shards={s: () for s in SPLIT_NAMES},
                   next_document={s: 0 for s in SPLIT_NAMES})

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["settings"] = self.settings.to_json()
        data["shards"] = {k: [dataclasses.asdict(s) for s in v] for k, v in self.shards.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunState:
        return cls(settings=TokenIndex.from_json(data["settings"]),
                   shards={k: tuple(Shard(**s) for s in v) for k, v in data["shards"].items()},
                   next_document=data["next_document"],
                   lowest_train=_extreme(data["lowest_train"]),
                   highest_validation=_extreme(data["highest_validation"]),
                   documents=data["documents"], complete=data["complete"],
                   rebalanced=data["rebalanced"])


def _extreme(saved: list | None) -> Extreme | None:
    return None if saved is None else (float(saved[0]), int(saved[1]), int(saved[2]))


def prepare(directory: Path, settings: TokenIndex, resume: bool) -> RunState | None:
    """The state to start from (fresh, or the saved one with `resume`), or None when `resume`
    finds the run already finished. Writes nothing; refuses a directory it would spoil."""
    if has_index(directory):
        if not resume:
            raise ValueError(f"--to {directory} already holds a tokenized corpus ({INDEX_FILE}); "
                             "choose another directory")
        _check_same(directory, read_index(directory, f"--to {directory}"), settings)
        return None
    progress = directory / PROGRESS_FILE
    if progress.is_file():
        if not resume:
            raise ValueError(f"--to {directory} holds an unfinished run: continue it with "
                             "--resume, or choose another directory")
        try:
            state = RunState.from_json(json.loads(progress.read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--to {directory}: {progress} is damaged ({e}); start again in "
                             "another directory") from None
        _check_same(directory, state.settings, settings)
        return state
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"--to {directory} is not an empty directory"
                         + (" (and holds no run to resume)" if resume else ""))
    return RunState.fresh(settings)


def _check_same(directory: Path, saved: TokenIndex, settings: TokenIndex) -> None:
    saved_json = {k: v for k, v in saved.to_json().items() if k not in ("splits", "total")}
    new_json = {k: v for k, v in settings.to_json().items() if k not in ("splits", "total")}
    differ = [f"{k}: {saved_json[k]} then, {new_json[k]} now" for k in saved_json
              if saved_json[k] != new_json.get(k)]
    if differ:
        raise ValueError(f"--to {directory} was tokenized with other options ("
                         f"{'; '.join(differ)}): resume with the same ones")


def save(directory: Path, state: RunState) -> None:
    write_json_atomically(directory / PROGRESS_FILE, state.to_json())


def finish(directory: Path, state: RunState) -> TokenIndex:
    """After the last document: correct the split, put every file in place, write the index."""
    state = _rebalance(directory, state)
    for shards in state.shards.values():
        for shard in shards:
            rename_shard(directory, shard)  # the correction's files, if a crash came between
    kept = {name for shards in state.shards.values() for s in shards
            for name in (s.tokens_file, s.offsets_file)}
    for path in directory.iterdir():  # a moved document's emptied shard, stray temporaries
        if _STRAY_FILE.match(path.name) and path.name not in kept:
            path.unlink()
    index = dataclasses.replace(state.settings,
                                splits={k: v for k, v in state.shards.items() if v})
    write_json_atomically(directory / INDEX_FILE, index.to_json())
    (directory / PROGRESS_FILE).unlink(missing_ok=True)
    return index


def _rebalance(directory: Path, state: RunState) -> RunState:
    """validation_mask's correction, if the stream needs it (see the module docstring)."""
    if state.rebalanced or state.documents < 2 or state.settings.val_fraction <= 0:
        return state
    if not state.shards["validation"] and state.lowest_train is not None:
        moved = _move_document(directory, state, "train", "validation", state.lowest_train[2])
    elif not state.shards["train"] and state.highest_validation is not None:
        moved = _move_document(directory, state, "validation", "train",
                               state.highest_validation[2])
    else:
        return state
    # Recorded before the new files take their names: a crash in between is finished by
    # finish()'s renames on the next --resume, never done twice.
    state = dataclasses.replace(state, shards=moved, rebalanced=True)
    save(directory, state)
    return state


def _move_document(directory: Path, state: RunState, source: str, target: str,
                   position: int) -> dict[str, tuple[Shard, ...]]:
    """The shards after moving document `position` of split `source` into the (empty) split
    `target`: its shard rewritten without it (dropped if it held nothing else), and a new
    shard for `target`, both under temporary names."""
    shards, dtype = list(state.shards[source]), state.settings.dtype
    counts = np.cumsum([s.documents for s in shards])
    number = int(np.searchsorted(counts, position, side="right"))
    inside = position - (int(counts[number - 1]) if number else 0)
    tokens, offsets = open_memmaps(directory, state.settings, shards[number])
    begin, end = int(offsets[inside]), int(offsets[inside + 1])
    size = _document_bytes(state.settings, tokens[begin:end - 1])
    writer = ShardWriter(directory, target, 0, dtype)
    writer.add(tokens[begin:end], text_bytes=size)
    moved = writer.finish(rename=False)
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    if shards[number].documents > 1:
        rewrite = ShardWriter(directory, source, int(shards[number].name[-5:]), dtype)
        rewrite.add(tokens[:begin], starts[:inside])
        rewrite.add(tokens[end:], starts[inside + 1:] - end)
        left = shards[number].text_bytes
        shards[number] = dataclasses.replace(rewrite.finish(rename=False),
                                             text_bytes=None if left is None else left - size)
    else:
        del shards[number]
    del tokens, offsets  # the old file is replaced next: let go of its mapping first
    return {**state.shards, source: tuple(shards), target: (moved,)}


def _document_bytes(settings: TokenIndex, ids: np.ndarray) -> int:
    """UTF-8 bytes of one document's text, from its ids (its end-of-text id left out): the
    text itself is no longer at hand when a finished run moves a document between splits."""
    from jaxpar.data.tokenizer import make_tokenizer  # noqa: PLC0415  (loaded only here)

    if settings.tokenizer.sha256 == "byte":
        return len(ids)
    return len(make_tokenizer(settings.tokenizer.name).decode(ids.tolist()).encode("utf-8"))
