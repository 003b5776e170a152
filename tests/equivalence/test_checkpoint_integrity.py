"""Checkpoint integrity: every array's checksum is recorded at save and verified after restore,
under any mesh; damaged files are one line naming the array; ``train.resume=auto`` chooses the
newest intact checkpoint (the run continuing exactly from it, through the command line:
``tests/integration/test_checkpoint.py``).

Damage is made as a bad disk would make it: bytes inverted in the middle of the largest array
data file (``helpers.flip_bytes``). Orbax does not notice that by itself: the restore returns
other numbers (``test_flipped_bytes_...`` shows it by switching verification off).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CHECKSUM_MISMATCH as MISMATCH
from helpers import flip_bytes, random_state, trainer_for

from jaxpar.checkpoint import integrity
from jaxpar.checkpoint import state as checkpoint
from jaxpar.checkpoint.state import DamagedCheckpointError, complete_steps
from jaxpar.config import load_config, validate

SAVE_MESH = ["mesh.data=8"]
OTHER_MESH = ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint of a random state saved under data=8, and a host copy of that state."""
    trainer = trainer_for(SAVE_MESH)
    run_dir = tmp_path_factory.mktemp("saved")
    cfg = validate(load_config("tiny", [*SAVE_MESH, f"run_dir={run_dir}"]), 8)
    state = random_state(trainer, 3)
    saver = checkpoint.Saver(cfg)
    saver.save(2, state, {"position": 2}, {"step": 2, "skipped_steps": 0})
    saver.close()
    return run_dir / "checkpoints" / "2", jax.device_get(state)


def copy_of(saved: tuple[Path, dict], tmp_path: Path, step: int = 2) -> Path:
    path = tmp_path / "checkpoints" / str(step)
    shutil.copytree(saved[0], path)
    return path


def names_of(state) -> list[str]:
    return [integrity.leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def differing(state, host) -> list[str]:
    got = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    return [integrity.leaf_name(p) for (p, a), b in zip(got, jax.tree.leaves(host), strict=True)
            if not np.array_equal(a, b)]


# --------------------------------------------------------------------------------------------
# The checksum itself.


def test_checksums_are_the_same_under_any_mesh_and_see_one_changed_element(saved):
    _, host = saved
    sums = {}
    for overrides in (SAVE_MESH, OTHER_MESH, ["mesh.data=1"]):
        abstract = trainer_for(overrides).abstract_state
        placed = jax.tree.map(lambda v, a: jax.device_put(v, a.sharding), host, abstract)
        sums[tuple(overrides)] = integrity.checksums(placed)
    first = sums[tuple(SAVE_MESH)]
    assert all(s == first for s in sums.values())
    assert len(set(first.values())) > len(first) // 2  # not one constant for every array

    changed = jax.tree.map(np.copy, host)
    wq = changed.params["layers"]["attn"]["wq"]
    wq[1, 3, 2, 1] = np.nextafter(wq[1, 3, 2, 1], np.float32(1))  # one bit of one element
    after = integrity.checksums(changed)
    assert [n for n in first if after[n] != first[n]] == ["params/layers/attn/wq"]


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "bool", "int32"])
def test_checksum_of_other_dtypes_is_sharding_free_and_sees_a_change(dtype):
    rows = jax.sharding.NamedSharding(jax.make_mesh((8,), ("rows",)),
                                      jax.sharding.PartitionSpec("rows"))
    values = np.arange(8 * 6).reshape(8, 6) % 5
    x = jnp.asarray(values).astype(dtype)
    sharded = jax.device_put(x, rows)
    changed = x.at[5, 4].set(jnp.asarray(values[5, 4] == 0).astype(dtype))
    assert int(integrity.array_checksum(x)) == int(jax.jit(integrity.array_checksum)(sharded))
    assert int(integrity.array_checksum(x)) != int(integrity.array_checksum(changed))
    # The same values at other positions: not the same checksum.
    assert int(integrity.array_checksum(x)) != int(integrity.array_checksum(jnp.flip(x, 0)))


# --------------------------------------------------------------------------------------------
# Restore verifies.


def test_intact_checkpoint_verifies_under_another_mesh(saved):
    path, host = saved
    restored = checkpoint.restore(path, trainer_for(OTHER_MESH).abstract_state)
    assert restored.verified and restored.path == path
    assert differing(restored.state, host) == []


def test_flipped_bytes_are_an_error_naming_the_damaged_array(saved, tmp_path, monkeypatch):
    path = copy_of(saved, tmp_path)
    flip_bytes(path)
    abstract = trainer_for(OTHER_MESH).abstract_state
    with pytest.raises(DamagedCheckpointError) as caught:
        checkpoint.restore(path, abstract)
    match = MISMATCH.match(str(caught.value))
    assert match, str(caught.value)
    assert match.group(1) == str(path) and match.group(2) in names_of(abstract)

    # Without verification orbax restores the damaged values silently: exactly the named array.
    monkeypatch.setattr(checkpoint, "_verify", lambda *args: True)
    assert differing(checkpoint.restore(path, abstract).state, saved[1]) == [match.group(2)]


def test_a_recorded_checksum_that_differs_names_that_array(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    record_file = path / "checksums" / "metadata"
    record = json.loads(record_file.read_text())
    record["arrays"]["opt_state/1/0/nu/lm_head"] ^= 1
    record_file.write_text(json.dumps(record))
    with pytest.raises(DamagedCheckpointError, match=MISMATCH.pattern.replace(
            "([^']+)", "opt_state/1/0/nu/lm_head")):
        checkpoint.restore(path, trainer_for(SAVE_MESH).abstract_state)


def test_unreadable_array_file_is_an_error_naming_an_array(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    largest = flip_bytes(path)
    largest.write_bytes(largest.read_bytes()[:100])  # truncated: zstd cannot decode it
    abstract = trainer_for(SAVE_MESH).abstract_state
    with pytest.raises(DamagedCheckpointError) as caught:
        checkpoint.restore(path, abstract)
    line = str(caught.value)
    match = re.match(rf"^checkpoint {re.escape(str(path))}: array '([^']+)' is unreadable "
                     r"\(damaged file\?\): \S", line)
    assert match and match.group(1) in names_of(abstract) and "\n" not in line, line


# --------------------------------------------------------------------------------------------
# Choosing what to resume from.


def resume_cfg(run_dir: Path, resume: str = "auto"):
    return validate(load_config("tiny", [*SAVE_MESH, f"run_dir={run_dir}",
                                         f"train.resume={resume}"]), 8)


def test_checkpoint_without_checksums_restores_with_a_notice(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    shutil.rmtree(path / "checksums")  # as saved before checksums were recorded
    said: list[str] = []
    restored = checkpoint.resume(resume_cfg(tmp_path), path,
                                 trainer_for(SAVE_MESH).abstract_state, said.append)
    assert not restored.verified and differing(restored.state, saved[1]) == []
    assert said == [f"checkpoint {path} holds no checksums (saved by an older jaxpar): its "
                    "arrays cannot be verified"]


def test_resume_auto_with_no_intact_checkpoint_is_the_error(saved, tmp_path):
    older, newer = copy_of(saved, tmp_path, 1), copy_of(saved, tmp_path, 2)
    flip_bytes(older), flip_bytes(newer)
    with pytest.raises(DamagedCheckpointError, match=rf"^checkpoint {re.escape(str(newer))}: "
                       r"array .* the older checkpoints are damaged too \(steps 1\)$"):
        checkpoint.resume(resume_cfg(tmp_path), newer, trainer_for(SAVE_MESH).abstract_state,
                          print)
    assert complete_steps(tmp_path / "checkpoints") == [1, 2]  # nothing moved
