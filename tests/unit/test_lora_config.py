"""``train.lora``'s configuration (docs/lora.md): the targets a model has, one-line errors."""

from __future__ import annotations

import math

import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.config.schema import LORA_TARGETS


def _error(*overrides: str, devices: int = 1, preset: str = "tiny") -> str:
    with pytest.raises(ConfigError) as info:
        validate(load_config(preset, ["train.lora.rank=4", *overrides]), devices)
    return str(info.value)


def test_lora_loads_targets_as_a_list() -> None:
    cfg = validate(load_config("tiny", ["train.lora.rank=4", "train.lora.targets=[q,v]"]), 1)
    assert cfg.train.lora.targets == ("q", "v")
    assert validate(load_config("tiny", []), 1).train.lora.targets == LORA_TARGETS


def test_a_target_the_model_does_not_have_is_one_line_naming_it() -> None:
    message = _error("train.lora.targets=[q,wq_proj]")
    assert "\n" not in message and "'wq_proj'" in message and "allowed: q, k, v" in message


def test_lora_refuses_what_it_does_not_run_yet() -> None:
    # A pipeline runs the adapters (tests/equivalence/test_lora_pipeline.py), without dropout.
    validate(load_config("tiny", ["train.lora.rank=4", "mesh.pipe=2", "train.microbatches=2"]),
             2)
    message = _error("mesh.pipe=2", "train.microbatches=2", "train.lora.dropout=0.1", devices=2)
    assert "\n" not in message and "mesh.pipe" in message and "train.lora.dropout" in message
    assert "train.lora.rank=-1" in _error("train.lora.rank=-1")


def test_lora_takes_moe_experts_and_dense_blocks() -> None:
    """Every target on moe-tiny (its feed-forward: the routed experts), and on MoE models with
    dense blocks, in a pipeline too; dense first blocks in a pipeline are one line."""
    validate(load_config("moe-tiny", ["train.lora.rank=4"]), 8)
    validate(load_config("moe-tiny", ["train.lora.rank=4", "model.n_layers=4",
                                      "model.moe.every=2", "model.moe.first_dense=2"]), 8)
    validate(load_config("moe-tiny", ["train.lora.rank=4", "mesh.pipe=2",
                                      "train.microbatches=2"]), 2)
    message = _error("mesh.pipe=2", "train.microbatches=2", "model.n_layers=3",
                     "model.moe.first_dense=1", preset="moe-tiny", devices=2)
    assert "\n" not in message and "first_dense" in message and "mesh.pipe" in message


@pytest.mark.parametrize("rate", ["1.0", "-0.1", "nan"])
def test_lora_dropout_outside_zero_to_one_is_one_line(rate: str) -> None:
    message = _error(f"train.lora.dropout={rate}")
    assert "\n" not in message and "train.lora.dropout=" in message and "[0, 1)" in message


def test_lora_dropout_refuses_expert_adapters_only() -> None:
    validate(load_config("tiny", ["train.lora.rank=4", "train.lora.dropout=0.1",
                                  "train.grad_accum=2"]), 1)
    validate(load_config("moe-tiny", ["train.lora.rank=4", "train.lora.dropout=0.1",
                                      "train.lora.targets=[q,k,v,o]"]), 8)
    message = _error("train.lora.dropout=0.1", preset="moe-tiny", devices=8)
    assert "\n" not in message and message.startswith("train.lora.dropout > 0")
    assert "allowed targets here: q, k, v, o" in message


@pytest.mark.parametrize(("preset", "mesh"), [
    ("tiny", ()), ("tiny", ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")),
    ("moe-tiny", ("mesh.data=2", "mesh.expert=2", "mesh.tensor=2"))])
def test_plan_counts_the_adapters_state_only(preset: str, mesh: tuple[str, ...]) -> None:
    """The cost model's optimizer bytes per device (what ``jaxpar plan`` and ``inspect
    --compare`` show) equal those of the state ``resolve_shardings`` lays out for a LoRA run,
    adapters only (on moe-tiny: the routed experts' adapters split over ``expert``); the frozen
    weights count neither state nor gradients (shapes only)."""
    import jax  # noqa: PLC0415

    from jaxpar.cost.params import param_costs  # noqa: PLC0415
    from jaxpar.mesh import make_mesh  # noqa: PLC0415
    from jaxpar.model.transformer import abstract_model  # noqa: PLC0415
    from jaxpar.parallel.optimizer_state import state_counters  # noqa: PLC0415
    from jaxpar.parallel.rules import param_logical_axes  # noqa: PLC0415
    from jaxpar.train.step import lora_of, make_optimizer, resolve_shardings, trained  # noqa: PLC0415

    n = 8 if mesh else 1
    cfg = validate(load_config(preset, ["train.lora.rank=4", *mesh]), n)
    tx = make_optimizer(cfg.train, trained(cfg, param_logical_axes(
        abstract_model(cfg.model, lora_of(cfg)))))
    state = resolve_shardings(cfg, make_mesh(cfg, devices=jax.devices()[:n]), tx)
    laid_out = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                   for a in jax.tree.leaves(state.abstract_state.opt_state))
    costs = param_costs(cfg)
    planned = (sum(p.state_bytes_per_device for p in costs)
               + state_counters(cfg.train.optimizer, cfg.train.weight_decay))
    assert planned == laid_out
    assert {p.name.split("/")[-2] for p in costs if p.trained} == {
        f"lora_{t}" for t in LORA_TARGETS}
    full = sum(p.state_bytes_per_device for p in param_costs(validate(load_config(
        preset, list(mesh)), n)))
    assert planned < full / 4


MLA = ("model.mla.q_lora_rank=24", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=12")


def test_an_mla_model_takes_its_latent_projections_and_refuses_q_k_v_in_one_line() -> None:
    targets = "train.lora.targets=[q_a,q_b,kv_a,kv_b,o,gate,up,down]"
    cfg = validate(load_config("tiny", ["train.lora.rank=4", *MLA, targets]), 1)
    assert cfg.train.lora.targets == ("q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")
    for target in ("q", "k", "v"):
        message = _error(*MLA, f"train.lora.targets=[o,{target}]")
        assert "\n" not in message and f"{target!r}" in message and "model.mla" in message
        assert "allowed here: q_a, q_b, kv_a, kv_b, o, gate, up, down" in message
    # Without a query latent (q_lora_rank 0) the query projection is W_q: "q", not q_a/q_b.
    no_latent = (*MLA[1:], "model.mla.q_lora_rank=0")
    validate(load_config("tiny", ["train.lora.rank=4", *no_latent,
                                  "train.lora.targets=[q,kv_a,kv_b]"]), 1)
    assert "'q_a'" in _error(*no_latent, "train.lora.targets=[q_a]")
    # ... and a model without latent attention has none of them.
    message = _error("train.lora.targets=[q,kv_b]")
    assert "\n" not in message and "'kv_b'" in message and "model.mla" in message


def test_plan_counts_the_mla_adapters_as_trained() -> None:
    from jaxpar.cost.params import param_costs  # noqa: PLC0415

    cfg = validate(load_config("tiny", ["train.lora.rank=4", *MLA,
                                        "train.lora.targets=[q_a,q_b,kv_a,kv_b,o]"]), 1)
    assert {p.name.split("/")[-2] for p in param_costs(cfg) if p.trained} == {
        "lora_q_a", "lora_q_b", "lora_kv_a", "lora_kv_b", "lora_o"}


def test_peft_export_of_expert_or_dense_block_adapters_is_one_line() -> None:
    """``--adapters-only`` (PEFT's directory) refuses a MoE model's expert adapters and MoE
    models with dense blocks; a MoE model's attention adapters pass."""
    from jaxpar.hf.peft import check_exportable  # noqa: PLC0415

    def refusal(*overrides: str) -> str:
        cfg = validate(load_config("moe-tiny", ["train.lora.rank=4", *overrides]), 8)
        with pytest.raises(ConfigError) as info:
            check_exportable(cfg)
        return str(info.value)

    message = refusal()
    assert "\n" not in message and "gate, up, down" in message and "routed experts" in message
    message = refusal("train.lora.targets=[q,o]", "model.moe.every=2")
    assert "\n" not in message and "dense blocks" in message
    check_exportable(validate(load_config("moe-tiny", ["train.lora.rank=4",
                                                       "train.lora.targets=[q,o]"]), 8))
