"""``jaxpar plan --search``'s enumeration and pruning (jaxpar/cost/search.py), and ``--verify``'s
bad input (one line, exit 2, before anything compiles)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from rich.console import Console

from jaxpar.cli.main import main
from jaxpar.config import ConfigError, load_config, validate
from jaxpar.config.schema import ParallelConfig, TrainConfig
from jaxpar.cost.estimate import estimate
from jaxpar.cost.search import (
    MeshLayout,
    _try,
    layouts,
    pipeline_fsdp_values,
    schema_values,
    search,
)
from jaxpar.hardware import get_profile
from jaxpar.inspect.verify import Verified, compile_depth, print_verification

DEVICES = 8


def _eight_layers() -> object:
    return load_config("tiny", ["model.n_layers=8", "train.batch_size=32"])


def test_layouts_add_pipelines_with_their_schedules_and_microbatches():
    cfg = _eight_layers()
    piped = [lay for lay in layouts(cfg, DEVICES) if lay.pipe > 1]
    schedules = set(schema_values(ParallelConfig, "pipeline_schedule")) - {"gpipe"}
    assert {lay.schedule for lay in piped} == schedules  # 1f1b, interleaved, zero_bubble, ...
    assert {lay.pipe for lay in piped} == {2, 4, 8}
    for lay in piped:
        rows = cfg.train.batch_size // (lay.data * lay.fsdp * lay.expert)
        assert lay.microbatches in (lay.pipe, 2 * lay.pipe, 4 * lay.pipe)
        assert rows % lay.microbatches == 0 or lay.microbatches == lay.pipe, lay
        if lay.schedule in ("interleaved", "dualpipe_v"):
            assert lay.virtual_stages == 2
        assert cfg.model.n_layers % (lay.pipe * lay.virtual_stages) == 0
        assert lay.schedule != "dualpipe_v" or lay.microbatches >= 2 * lay.pipe
    # Zero bubble on the ring of devices, and interleaved over two chunks a stage.
    assert {lay.virtual_stages for lay in piped if lay.schedule == "zero_bubble"} == {1, 2}
    assert {lay.virtual_stages for lay in piped if lay.schedule == "1f1b"} == {1}
    # pipe=2 with 16 rows a replica: 2, 4 and 8 microbatches.
    assert {lay.microbatches for lay in piped if lay.pipe == 2 and lay.data == 2} == {2, 4, 8}
    # Where the config has parallel.pipeline_fsdp, each value is searched with fsdp > 1.
    modes = {lay.pipeline_fsdp for lay in piped if lay.fsdp > 1}
    assert modes == set(pipeline_fsdp_values())
    assert all(lay.pipeline_fsdp is None for lay in layouts(cfg, DEVICES) if lay.fsdp == 1)


def test_gpipe_is_left_out_because_1f1b_is_never_larger_nor_more_than_two_launches_slower():
    # Their ticks are the same; GPipe's turn step, which runs once, drops the embedding sums
    # no stage reads there (program.describe), a launch latency or two on this tiny model.
    cfg = _eight_layers()
    hw = get_profile("tpu-v5e")
    for pipe, data, m in ((2, 4, 4), (4, 2, 8), (8, 1, 16)):
        lay = MeshLayout(data, 1, 1, 1, pipe=pipe, schedule="1f1b", microbatches=m)
        one = estimate(validate(lay.apply(cfg, "none", False), DEVICES), hw)
        gpipe = dataclasses.replace(lay, schedule="gpipe")
        two = estimate(validate(gpipe.apply(cfg, "none", False), DEVICES), hw)
        assert one.memory.peak <= two.memory.peak
        assert one.time.step <= 1.1 * two.time.step  # two launches and their bytes: 5.4%


def test_every_remat_policy_of_the_schema_is_searched():
    remats = typing.get_args(typing.get_type_hints(TrainConfig)["remat"])
    assert schema_values(TrainConfig, "remat") == remats and "none" in remats


def _brute_force_best(cfg, lay: MeshLayout, hw):
    """The fastest fitting (remat, offload) of one layout, every combination estimated; offload
    only where nothing fits without (its host transfers are not timed); ties: least memory."""
    tried = [_try(cfg, lay, r, o, DEVICES, hw) for r in schema_values(TrainConfig, "remat")
             for o in (False, True)]
    fitting = [c for c in tried if c.fits]
    return min(fitting, key=lambda c: (c.offload, c.report.memory.host > 0, c.report.time.step,
                                       c.report.memory.peak), default=None)


def test_the_levers_chosen_are_the_fastest_that_fit():
    """llama-1b on 8 x TPU v5e (16 GiB): where remat=none does not fit, the search takes the
    fastest remat/offload that does, as trying every combination would."""
    cfg = load_config("llama-1b")
    hw = get_profile("tpu-v5e")
    candidates = search(cfg, DEVICES, hw, keep=None)
    fitting = [c for c in candidates if c.fits]
    assert len({c.remat for c in fitting}) >= 2  # some layouts need more than the fastest
    for c in fitting[:12]:
        best = _brute_force_best(cfg, c.layout_, hw)
        assert (c.remat, c.offload) == (best.remat, best.offload), c.layout
    for c in candidates:  # rejected for memory: no combination fits
        if c.reason and c.reason.startswith("needs "):
            assert _brute_force_best(cfg, c.layout_, hw) is None, c.layout
            assert "even with remat=" in c.reason


def test_pruning_keeps_the_top_k_exact():
    cfg = load_config("llama-1b", ["model.n_layers=4"])
    every = search(cfg, DEVICES, "tpu-v5e", keep=None)
    top = search(cfg, DEVICES, "tpu-v5e", keep=5)
    assert any(c.pruned for c in top) and not any(c.pruned for c in every)
    key = [(c.layout, c.microbatches, c.remat, c.offload) for c in every if c.fits][:5]
    assert [(c.layout, c.microbatches, c.remat, c.offload) for c in top if c.fits][:5] == key
    # Pruned layouts are slower, even with remat=none, than the fifth.
    fifth = [c for c in top if c.fits][4].report.time.step
    assert all(c.report.time.step > fifth for c in top if c.pruned)


def test_offload_is_not_tried_on_cpu_where_host_and_device_are_one_memory():
    cfg = load_config("llama-1b", ["model.n_layers=4"])
    assert not any(c.offload for c in search(cfg, DEVICES, "cpu"))


def test_search_ranks_pipelines_and_says_why_layouts_fail():
    cfg = _eight_layers()
    candidates = search(cfg, DEVICES, "h100", keep=40)
    assert any(c.fits and c.pipe > 1 for c in candidates)
    assert any(c.reason and "not divisible by mesh.tensor=8" in c.reason for c in candidates)
    for c in candidates:
        if c.fits:  # each ranked candidate is a config jaxpar accepts as it stands
            validate(load_config("tiny", ["model.n_layers=8", "train.batch_size=32",
                                          *c.overrides()]), DEVICES)


@pytest.mark.parametrize(("args", "message"), [
    (["--verify", "1"], "--verify 1 needs --target TPU"),
    (["--verify", "0", "--target", "tpu-v5e:2x4"], "argument --verify: expected a whole number"),
    (["--verify", "1", "--target", "tpu-v5e:2x4", "--slices", "0"],
     "argument --slices: expected a whole number"),
    (["--verify", "1", "--target", "tpu-v5e:2x4", "--slices", "3"],
     "--slices 3 does not divide the 8 devices"),
    (["--target", "tpu-v5e:2x4"], "--target and --slices go with --verify K"),
    (["--all"], "--all goes with --search"),
    (["--verify", "1", "--target", "tpu-v5e:9"], "--target tpu-v5e:9: expected"),
    (["--verify", "1", "--target", "tpu-v5p:2x2x2", "--hardware", "tpu-v5e"],
     "plan for it with --hardware tpu-v5p"),
])
def test_bad_verify_input_is_one_line_and_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) if "argument" in message else _no_raise() as exit_:
        code = main(["plan", "tiny", "--devices", "8", "--hardware", "tpu-v5e", *args])
    code = exit_.value.code if "argument" in message else code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_layout_overrides_reach_the_config():
    lay = MeshLayout(2, 2, 1, 1, pipe=2, schedule="interleaved", virtual_stages=2, microbatches=4)
    cfg = lay.apply(_eight_layers(), "dots", True)
    assert cfg.mesh.pipe == 2 and cfg.parallel.pipeline_schedule == "interleaved"
    assert cfg.parallel.virtual_stages == 2 and cfg.train.microbatches == 4
    assert cfg.train.remat == "dots" and cfg.train.offload.optimizer
    with pytest.raises(ConfigError):
        validate(MeshLayout(8, 1, 1, 1, pipe=1, microbatches=2).apply(cfg, "none", False), 8)


def test_verify_compiles_the_fewest_layers_the_layout_takes():
    cfg = _eight_layers()
    for lay, layers in ((MeshLayout(8, 1, 1, 1), 2),
                        (MeshLayout(2, 1, 1, 1, pipe=4, schedule="1f1b", microbatches=4), 4),
                        (MeshLayout(4, 1, 1, 1, pipe=2, schedule="interleaved", virtual_stages=2,
                                microbatches=4), 4)):
        assert compile_depth(validate(lay.apply(cfg, "none", False), DEVICES), DEVICES) == layers
    assert compile_depth(validate(load_config("tiny"), DEVICES), DEVICES) == 2  # its own depth


def test_verify_fails_a_candidate_whose_full_depth_peak_is_over_the_hbm():
    """The full-depth figure: the compiled peak where nothing was cut, else the plan's full-depth
    peak times compiled / predicted at the depth compiled; over the chip's HBM: exit 1."""
    hw = get_profile("tpu-v5e")
    best = next(c for c in search(_eight_layers(), DEVICES, hw) if c.fits)
    full = best.report.memory.peak
    fits = Verified(best, 2, 8, predicted_peak=100, compiled_peak=110, predicted_host=0,
                    compiled_host=0, predicted_full_peak=full)
    assert fits.ratio == pytest.approx(1.1) and fits.full_peak == pytest.approx(1.1 * full)
    over = dataclasses.replace(fits, compiled_peak=int(100 * hw.hbm_bytes / full) + 100)
    console = Console(record=True, width=200)
    assert print_verification([fits], hw, "tpu-v5e:2x4", console) == 0
    assert print_verification([fits, over], hw, "tpu-v5e:2x4", console) == 1
    assert "do not fit" in console.export_text()
    whole = dataclasses.replace(fits, layers=8)  # nothing cut: the compiled peak itself
    assert whole.full_peak == 110
