"""The options every step is compiled with (``jaxpar.mesh.step_compiler_options``)."""

from __future__ import annotations

from jaxpar.mesh import TPU_COMPILER_OPTIONS, step_compiler_options


def test_a_tpu_step_asks_for_collective_matmuls_of_the_weight_gathers(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert step_compiler_options("tpu") == TPU_COMPILER_OPTIONS == {
        "xla_tpu_all_gather_collective_matmul_mode": "post_spmd"}


def test_other_platforms_compile_with_their_defaults(monkeypatch):
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert step_compiler_options("cpu") is None
    assert step_compiler_options("gpu") is None


def test_a_flag_the_user_set_in_libtpu_init_args_stays_theirs(monkeypatch):
    monkeypatch.setenv("LIBTPU_INIT_ARGS",
                       "--foo=1 --xla_tpu_all_gather_collective_matmul_mode=pre_spmd")
    assert step_compiler_options("tpu") == {}
