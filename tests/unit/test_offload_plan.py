"""What ``jaxpar plan`` counts for ``train.offload.optimizer`` (docs/memory.md#host-offload): on
an accelerator the optimizer state moves from the device's train state to host memory, and the
update's part of the peak takes it back in and out; on XLA:CPU, whose memory analysis counts
host buffers with the rest, nothing moves."""

from __future__ import annotations

from jaxpar.config import load_config, validate
from jaxpar.cost.estimate import estimate

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
