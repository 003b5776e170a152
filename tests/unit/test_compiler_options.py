"""The options every step is compiled with (``jaxpar.mesh.step_compiler_options``)."""

from __future__ import annotations

from helpers import tiny_8x32

from jaxpar.mesh import step_compiler_options
from jaxpar.platform import SP_TPU_COMPILER_OPTIONS, TPU_COMPILER_OPTIONS

FSDP = tiny_8x32("mesh.data=1", "mesh.fsdp=8")
SP = tiny_8x32("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "parallel.sequence_parallel=true")


def test_a_tpu_step_asks_for_collective_matmuls_of_the_weight_gathers(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert step_compiler_options("tpu", FSDP) == TPU_COMPILER_OPTIONS == {
        "xla_tpu_all_gather_collective_matmul_mode": "post_spmd"}


def test_other_platforms_compile_with_their_defaults(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert step_compiler_options("cpu", SP) is None
    assert step_compiler_options("gpu", SP) is None


def test_a_flag_the_user_set_in_libtpu_init_args_stays_theirs(monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS",
                       "--foo=1 --xla_tpu_all_gather_collective_matmul_mode=pre_spmd")
    assert step_compiler_options("tpu", FSDP) == {}


def test_sequence_parallelism_asks_for_collective_matmuls_of_its_reduce_scatters_too(
        monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert step_compiler_options("tpu", SP) == {**TPU_COMPILER_OPTIONS, **SP_TPU_COMPILER_OPTIONS}
    assert SP_TPU_COMPILER_OPTIONS == {"xla_tpu_reduce_scatter_collective_matmul_mode": "post_spmd"}
    monkeypatch.setenv("LIBTPU_INIT_ARGS",
                       "--xla_tpu_reduce_scatter_collective_matmul_mode=pre_spmd")
    assert step_compiler_options("tpu", SP) == TPU_COMPILER_OPTIONS
