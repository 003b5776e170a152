"""Checkpoints: exact resume after SIGKILL, kills during async saves, SIGTERM/SIGINT, restore onto
other meshes, non-finite steps, incompatible or corrupt checkpoints, export, and the fall back of
``train.resume=auto`` from a damaged checkpoint to the newest intact one.

Runs that are killed go through the CLI in subprocesses (``python -m jaxpar.cli``) on the tiny
preset (8 virtual CPU devices). They share a persistent compilation cache, so only the first
process of each config pays for the compile. Losses are compared with ``==``: a resumed run must
take bitwise the steps of an uninterrupted one. The restores onto other meshes run in this process,
beside the command-line tests that read the same saved checkpoints (one module fixture, built
once); a non-finite step in process: ``tests/equivalence/test_nonfinite_step.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import CHECKSUM_MISMATCH as MISMATCH
from helpers import (
    assert_one_line_error,
    cached_jax_env,
    flip_bytes,
    losses,
    metrics,
    random_state,
    run_jaxpar,
    synthetic_batch,
    trainer_for,
)

from jaxpar.checkpoint import state as checkpoint
from jaxpar.checkpoint import weights as weights_only
from jaxpar.checkpoint.state import CheckpointError, complete_steps
from jaxpar.config import load_config, to_dict, validate

TIMEOUT_S = 240
COMMON = ["logging.every=1", "logging.progress=false"]
TMP_SUFFIX = ".orbax-checkpoint-tmp"

# Test side only: a process that runs the CLI but blocks forever when it asks for batch N, so the
# test can kill it at a known step (after step N-1 and its checkpoint save have started).
BLOCKING_DRIVER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from jaxpar.data.loader import DataIterator

    block_at, marker = int(sys.argv[1]), Path(sys.argv[2])
    original, count = DataIterator.__next__, 0

    def next_or_block(self):
        global count
        count += 1
        if count == block_at:
            marker.write_text("blocked")
            while True:
                time.sleep(60)
        return original(self)

    DataIterator.__next__ = next_or_block
    from jaxpar.cli.main import main
    sys.exit(main(sys.argv[3:]))
""")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return cached_jax_env(tmp_path_factory.mktemp("jax-cache"))


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxpar.cli", *args]


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run_jaxpar(*args, env=env, timeout=TIMEOUT_S)


def train_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "tiny", f"train.steps={steps}", f"run_dir={run_dir}", *COMMON, *extra]


def rows_written(run_dir: Path) -> int:
    """Complete lines in metrics.jsonl (safe to call while a run appends to it)."""
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def wait_for(condition, what: str, proc: subprocess.Popen | None = None,
             timeout: float = TIMEOUT_S, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def tmp_dirs(root: Path) -> list[str]:
    try:
        return [p for p in os.listdir(root) if TMP_SUFFIX in p]
    except FileNotFoundError:
        return []


_references: dict[int, Path] = {}


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """run_dir of an uninterrupted run of ``steps`` steps (saving every step), made once."""

    def make(steps: int) -> Path:
        if steps not in _references:
            run_dir = tmp_path_factory.mktemp(f"reference-{steps}")
            result = run(env, *train_args(run_dir, steps, "checkpoint.every=1"))
            assert result.returncode == 0, result.stderr[-3000:]
            assert sorted(losses(run_dir)) == list(range(1, steps + 1))
            _references[steps] = run_dir
        return _references[steps]

    return make


# --------------------------------------------------------------------------------------------
# Exact resume.


def test_sigkill_after_step_3_then_resume_gives_identical_losses(env, reference, tmp_path):
    expected = losses(reference(6))
    run_dir, marker = tmp_path / "run", tmp_path / "blocked"
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKING_DRIVER, "4", str(marker),
         *train_args(run_dir, 6, "checkpoint.every=3")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        wait_for(marker.exists, "the run to reach step 4", proc)
        wait_for(lambda: 3 in complete_steps(run_dir / "checkpoints"), "checkpoint 3", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(losses(run_dir)) == [1, 2, 3]

    result = run(env, *train_args(run_dir, 6, "checkpoint.every=3"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from step 3 ({run_dir / 'checkpoints' / '3'})" in result.stdout
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    for step in (4, 5, 6):
        assert resumed[step] == expected[step], (step, resumed[step], expected[step])
    assert resumed == expected

    # A run that is already done says so and exits 0 without touching anything.
    again = run(env, *train_args(run_dir, 6, "checkpoint.every=3"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "is at step 6" in again.stdout and "nothing to train" in again.stdout
    assert losses(run_dir) == expected


def test_sigkill_during_async_saves_always_resumes_from_a_complete_checkpoint(env, reference,
                                                                              tmp_path):
    """Five kills at random moments while a save is being written (a temporary directory is
    there); each restart must resume from the newest complete checkpoint, and the run, finished
    at last, must have taken exactly the steps of an uninterrupted one."""
    steps = 30
    expected = losses(reference(steps))
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    args = train_args(run_dir, steps, "checkpoint.every=1", "checkpoint.keep=2")
    rng = random.Random(7)
    newest, mid_save_kills = None, 0
    for _ in range(5):
        out = tmp_path / "stdout.txt"
        with out.open("w") as stdout:
            proc = subprocess.Popen(cli(*args), stdout=stdout, stderr=subprocess.PIPE, env=env)
            try:
                for _ in range(rng.randint(1, 3)):  # the 1st, 2nd or 3rd save of this process
                    seen = set(tmp_dirs(root))
                    wait_for(lambda seen=seen: set(tmp_dirs(root)) - seen, "a save", proc)
                time.sleep(rng.uniform(0, 0.02))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        if newest is not None:
            assert f"resumed from step {newest} " in out.read_text(), out.read_text()[-2000:]
        mid_save_kills += bool(tmp_dirs(root))
        steps_on_disk = complete_steps(root)
        assert steps_on_disk, "no complete checkpoint after the kill"
        newest = steps_on_disk[-1]
        assert newest < steps
    assert mid_save_kills >= 1  # the point: kills land while a save is in flight

    result = run(env, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from step {newest} " in result.stdout
    assert not tmp_dirs(root)  # leftovers of killed saves are cleaned up
    assert complete_steps(root) == [steps - 1, steps]  # checkpoint.keep=2
    assert losses(run_dir) == expected


def test_sigterm_and_sigint_save_and_exit_cleanly_then_resume_exactly(env, reference, tmp_path):
    steps = 30
    expected = losses(reference(steps))
    run_dir = tmp_path / "run"
    args = train_args(run_dir, steps, "checkpoint.every=10")
    stopped_at = []
    for sig, rows in ((signal.SIGTERM, 2), (signal.SIGINT, 2)):
        before = rows_written(run_dir)
        proc = subprocess.Popen(cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        wait_for(lambda before=before, rows=rows: rows_written(run_dir) >= before + rows,
                 "training to start", proc)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, stderr[-3000:]
        last = stdout.strip().splitlines()[-1]
        assert last.startswith(f"stopped by {sig.name} at step "), last
        step = int(last.split(" at step ")[1].split("/")[0])
        assert step < steps
        assert f"saved {run_dir / 'checkpoints' / str(step)}" in last
        assert complete_steps(run_dir / "checkpoints")[-1] == step
        stopped_at.append(step)
    assert stopped_at[1] > stopped_at[0]

    result = run(env, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from step {stopped_at[1]} " in result.stdout
    assert losses(run_dir) == expected


# --------------------------------------------------------------------------------------------
# Non-finite steps (train.lr=1e30: step 1 is fine, its update overflows the next gradient).


def test_on_nonfinite_stop_exits_1_naming_the_step_and_saves_nothing_after_it(env, tmp_path):
    run_dir = tmp_path / "run"
    result = run(env, *train_args(run_dir, 6, "train.lr=1e30", "checkpoint.every=1",
                                  "train.on_nonfinite=stop"))
    assert_one_line_error(result, "non-finite", "at step 2", "train.on_nonfinite=stop", code=1)
    assert complete_steps(run_dir / "checkpoints") == [1]
    assert [row["step"] for row in metrics(run_dir)] == [1]


def test_on_nonfinite_skip_drops_updates_and_counts_them(env, tmp_path):
    run_dir = tmp_path / "run"
    result = run(env, *train_args(run_dir, 6, "train.lr=1e30", "checkpoint.every=3",
                                  "train.on_nonfinite=skip"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert [row["skipped_steps"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert all(row["grad_norm"] is None for row in rows[1:])  # JSON null, not NaN
    assert "5 updates skipped" in result.stdout
    assert complete_steps(run_dir / "checkpoints") == [3, 6]


# --------------------------------------------------------------------------------------------
# Restore onto other meshes, in one process (8 virtual devices; 1 device = a prefix of them).

SAVE_MESHES = {
    "fsdp4-tensor2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "data2-context2-tensor2-sp": ["mesh.data=2", "mesh.context=2", "mesh.tensor=2",
                                  "parallel.sequence_parallel=true"],
}
RESTORE_MESHES = {
    "data8": ["mesh.data=8"],
    "data4-fsdp2-zero1": ["mesh.data=4", "mesh.fsdp=2", "parallel.zero=1"],
    "1-device": ["mesh.data=1"],
    # Pipeline stages each read their own layers: the stacked dimension is split over pipe.
    "pipe2-data2-tensor2": ["mesh.pipe=2", "mesh.data=2", "mesh.tensor=2",
                            "train.microbatches=2"],
}


def eval_loss(trainer, state, batch_seed: int = 99) -> float:
    loss, _ = trainer.loss_and_grads(state, synthetic_batch(trainer, batch_seed))
    return float(loss)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per save mesh: (checkpoint path, host copy of the state, eval loss there, config)."""
    out = {}
    for seed, (name, overrides) in enumerate(SAVE_MESHES.items()):
        trainer = trainer_for(overrides)
        cfg = dataclasses.replace(trainer.cfg, run_dir=str(tmp_path_factory.mktemp(name)))
        state = random_state(trainer, seed)
        saver = checkpoint.Saver(cfg)
        saver.save(2, state, {"position": 2}, {"step": 2, "skipped_steps": 0})
        saver.close()
        out[name] = (Path(cfg.run_dir) / "checkpoints" / "2", jax.device_get(state),
                     eval_loss(trainer, state), cfg)
    return out


@pytest.mark.parametrize("target", list(RESTORE_MESHES))
def test_restore_onto_other_meshes_gives_equal_state_and_eval_loss(saved, target):
    trainer = trainer_for(RESTORE_MESHES[target])
    for source, (path, host, loss, _) in saved.items():
        restored = checkpoint.restore(path, trainer.abstract_state)
        assert restored.data == {"position": 2} and restored.meta["step"] == 2
        assert restored.verified  # every array matched its checksum under this mesh
        state = restored.state
        # Each array arrives in this mesh's sharding (read shard by shard, no gather).
        for array, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(
                trainer.state_shardings), strict=True):
            assert array.sharding == sharding, (source, target)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), host)
        # The same parameters; the meshes sum in different orders (a few float32 ulps: 1.9e-6
        # of 5.5 measured from data2-context2-tensor2-sp to 1 device).
        assert eval_loss(trainer, state) == pytest.approx(loss, rel=1e-6), (source, target)


def test_export_writes_safetensors_equal_to_the_params(saved, tmp_path):
    from safetensors.numpy import load_file

    path, host, _, cfg = saved["fsdp4-tensor2"]
    weights, config_json, step = weights_only.export(path.parent.parent, tmp_path / "out")
    assert step == 2
    tensors = load_file(str(weights))
    flat = {"/".join(str(k.key) for k in p): v
            for p, v in jax.tree_util.tree_flatten_with_path(host.params)[0]}
    assert sorted(tensors) == sorted(flat)
    assert "layers/attn/wq" in tensors
    for name, value in flat.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    info = json.loads(config_json.read_text())
    assert info["model"] == to_dict(cfg)["model"] and info["step"] == 2
    assert info["params"]["layers/attn/wq"]["axes"] == ["layers", "embed", "heads", "head_dim"]


def test_export_cli(saved, env, tmp_path):
    path = saved["data2-context2-tensor2-sp"][0]
    result = run(env, "export", str(path), "--to", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert_one_line_error(run(env, "export", str(tmp_path / "nowhere"), "--to",
                              str(tmp_path / "x")), "no complete checkpoint", code=2)


# --------------------------------------------------------------------------------------------
# Incompatible and corrupt checkpoints: one line, exit 2, nothing written.


def test_checkpoint_of_another_model_shape_names_the_array(saved, env, tmp_path):
    path = saved["fsdp4-tensor2"][0]
    trainer = trainer_for(["mesh.data=8", "model.d_ff=256"])
    with pytest.raises(CheckpointError, match="params/layers/mlp/w_down"):
        checkpoint.restore(path, trainer.abstract_state)

    run_dir = tmp_path / "run"
    result = run(env, *train_args(run_dir, 6, "model.d_ff=256", f"train.resume={path}"))
    assert_one_line_error(result, str(path), "params/layers/mlp/w_down", "[2, 128, 64]",
                          "[2, 256, 64]", code=2)
    assert not run_dir.exists()


def test_corrupt_checkpoint_is_one_line_error_exit_2(saved, env, tmp_path):
    path = tmp_path / "checkpoints" / "2"
    shutil.copytree(saved["fsdp4-tensor2"][0], path)
    for data_file in (path / "state").rglob("d/*"):
        data_file.write_bytes(b"garbage")
    run_dir = tmp_path / "run"
    result = run(env, *train_args(run_dir, 6, "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                                  f"train.resume={path}"))
    assert_one_line_error(result, str(path), "array '", "is unreadable (damaged file?)", code=2)
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------
# Which checkpoint train.resume picks, and refusing to overwrite newer checkpoints.


def test_resume_choices(saved, tmp_path):
    _, _, _, saved_cfg = saved["fsdp4-tensor2"]
    run_dir = Path(saved_cfg.run_dir)
    root = run_dir / "checkpoints"
    (root / f"7{TMP_SUFFIX}").mkdir()  # a killed save: ignored
    try:
        def pick(value: str, run: Path = run_dir) -> Path | None:
            cfg = validate(load_config("tiny", [f"run_dir={run}", f"train.resume={value}"]), 8)
            return checkpoint.find_checkpoint(cfg)

        assert pick("auto") == root / "2"
        assert pick("never") is None
        assert pick("2") == root / "2"
        assert pick(str(run_dir), tmp_path) == root / "2"
        assert pick(str(root), tmp_path) == root / "2"
        assert pick(str(root / "2"), tmp_path) == root / "2"
        assert pick("auto", tmp_path) is None
        with pytest.raises(CheckpointError, match=r"train.resume=7: no complete checkpoint for "
                           r"step 7 .*complete: 2\)"):
            pick("7")
        with pytest.raises(CheckpointError, match="no complete checkpoint there"):
            pick(str(root / f"7{TMP_SUFFIX}"), tmp_path)

        never = validate(load_config("tiny", [f"run_dir={run_dir}", "train.resume=never"]), 8)
        with pytest.raises(CheckpointError, match="already holds checkpoints .newest: step 2"):
            checkpoint.check_run_dir_free(never, None)
        with pytest.raises(CheckpointError, match=r"later checkpoints \(2\)"):
            checkpoint.check_run_dir_free(never, 1)
        checkpoint.check_run_dir_free(never, 2)
    finally:
        (root / f"7{TMP_SUFFIX}").rmdir()


def test_processes_that_find_different_checkpoints_all_raise(saved, monkeypatch):
    """Under several processes each looks at run_dir itself; if they disagree (run_dir not on a
    shared file system), every process gets the same one-line error. The runtime is faked: this
    tests the decision, not the collective."""
    run_dir = Path(saved["fsdp4-tensor2"][3].run_dir)
    cfg = validate(load_config("tiny", [f"run_dir={run_dir}"]), 8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    gathered = []

    def allgather(value):
        gathered.append(int(value))
        return np.array([int(value), -1])  # process 1 sees no checkpoint

    monkeypatch.setattr(checkpoint.multihost_utils, "process_allgather", allgather)
    with pytest.raises(CheckpointError, match=r"the processes find different checkpoints to "
                       r"resume from \(process 0: 2, process 1: none\); run_dir must be on a "
                       "file system that every process shares"):
        checkpoint.find_checkpoint(cfg)
    assert gathered == [2]
    monkeypatch.setattr(checkpoint.multihost_utils, "process_allgather",
                        lambda value: np.array([int(value)] * 2))
    assert checkpoint.find_checkpoint(cfg) == run_dir / "checkpoints" / "2"


# --------------------------------------------------------------------------------------------
# Damaged checkpoints: train.resume=auto falls back to the newest intact one.


def test_resume_auto_falls_back_to_the_newest_intact_checkpoint_and_continues_exactly(
        tmp_path_factory, tmp_path):
    env = cached_jax_env(tmp_path_factory.mktemp("jax-cache"))
    common = ["logging.every=1", "logging.progress=false", "checkpoint.every=2"]

    def train(run_dir: Path, steps: int, *extra: str):
        return run_jaxpar("train", "tiny", f"train.steps={steps}", f"run_dir={run_dir}",
                          *common, *extra, env=env, timeout=TIMEOUT_S)

    reference = tmp_path / "reference"
    assert train(reference, 6).returncode == 0
    run_dir = tmp_path / "run"
    first = train(run_dir, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    root = run_dir / "checkpoints"
    assert complete_steps(root) == [2, 4]
    flip_bytes(root / "4")

    # Named explicitly, a damaged checkpoint is the error, and nothing changes.
    line = assert_one_line_error(train(run_dir, 6, "train.resume=4"), "does not match its "
                                 "checksum (damaged file?)", code=2)
    assert MISMATCH.match(line.removeprefix("jaxpar: error: ")), line
    assert complete_steps(root) == [2, 4] and sorted(losses(run_dir)) == [1, 2, 3, 4]

    result = train(run_dir, 6)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [x for x in result.stdout.splitlines() if "does not match its checksum" in x]
    assert warnings == [f"{line.removeprefix('jaxpar: error: ')}; resuming from step 2 "
                        f"({root / '2'}), the newest intact checkpoint, instead (moved the "
                        "damaged one to 4.damaged)"], result.stdout
    assert f"resumed from step 2 ({root / '2'})" in result.stdout
    assert (root / "4.damaged" / "state").is_dir()
    assert complete_steps(root) == [2, 4, 6]
    assert losses(run_dir) == losses(reference)
