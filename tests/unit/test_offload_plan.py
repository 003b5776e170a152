"""What ``jaxpar plan`` counts for ``train.offload.optimizer`` (docs/memory.md#host-offload): on
an accelerator the optimizer state moves from the device's train state to host memory, and the
update's part of the peak takes it back in and out; on XLA:CPU, whose memory analysis counts
host buffers with the rest, nothing moves."""

from __future__ import annotations

import pytest

from jaxpar.config import ConfigError, load_config, validate
from jaxpar.cost.estimate import estimate
from jaxpar.train.step import check_host_memory

LAYOUT = ["mesh.data=2", "mesh.fsdp=4"]


def memory(offload: bool, hardware: str | None):
    cfg = validate(load_config("tiny", [*LAYOUT, f"train.offload.optimizer={offload}"]), 8)
    return estimate(cfg, hardware).memory


def test_the_offloaded_state_is_host_memory_on_an_accelerator():
    plain, offloaded = memory(False, "tpu-v5p"), memory(True, "tpu-v5p")
    assert plain.host == 0 and offloaded.host == plain.optimizer > 0
    assert offloaded.state == plain.state - plain.optimizer
    update = offloaded.gradients + max(offloaded.gradient_sums, offloaded.update)
    assert offloaded.peak >= offloaded.state + offloaded.batch + update + 2 * offloaded.host


def test_on_xla_cpu_nothing_moves():
    plain, offloaded = memory(False, None), memory(True, None)
    assert offloaded.host == 0 and offloaded.state == plain.state
    assert offloaded.peak == plain.peak


class _Memory:
    def __init__(self, kind: str):
        self.kind = kind


class _Device:
    platform = "metal"

    def __init__(self, *kinds: str):
        self.kinds = kinds

    def addressable_memories(self):
        return [_Memory(k) for k in self.kinds]


@pytest.mark.parametrize("override", ["train.offload.optimizer=true", "train.remat=offload_dots"])
def test_offload_on_a_platform_without_host_memory_is_a_one_line_config_error(override):
    cfg = validate(load_config("tiny", [override]), 8)
    with pytest.raises(ConfigError, match=r"^train\.\S+: metal devices have no pinned_host "
                                          r"memory \(their memory kinds: device\)"):
        check_host_memory(cfg, _Device("device"))
    check_host_memory(cfg, _Device("device", "pinned_host"))  # CPU, GPU, TPU
    check_host_memory(validate(load_config("tiny"), 8), _Device("device"))  # nothing asked
