"""MFU of configs/llama-1b.yaml in bf16 on a GPU or TPU (``benchmark.py --mfu``).

UNTESTED: written without an accelerator. It reuses the CPU matrix's measurement
(:func:`bench_run.measure`) on all local devices, with ``model.attention=auto`` (cuDNN on a GPU
in bf16; see :mod:`jaxpar.model.attention`), and computes MFU as the train loop does: useful
flops per device (``train_flops_per_token`` x tokens / devices) per second over the dense bf16
peak :func:`jaxpar.hardware.peak_flops` assumes for the device kind, which it prints.
"""

from __future__ import annotations

import jax

from jaxpar.config import load_config, validate
from jaxpar.hardware import peak_flops

MFU_OVERRIDES = ["train.dtype=bfloat16", "model.attention=auto"]


def run_mfu(overrides: list[str], *, steps: int, warmup: int) -> int:
    """Print llama-1b's bf16 step time, tokens/s and MFU; exit status 2 without an accelerator."""
    backend = jax.default_backend()
    if backend not in ("gpu", "tpu"):
        print(f"--mfu needs a GPU or TPU (jax's backend here is {backend!r}): MFU on a CPU has "
              "no meaningful peak. Run the layout matrix without --mfu instead.")
        return 2
    from bench_run import measure  # noqa: PLC0415

    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    if peak is None:
        print(f"no peak FLOP/s known for device kind {kind!r} (jaxpar/train/metrics.py)")
        return 2
    devices = jax.devices()
    cfg = validate(load_config("llama-1b", [*MFU_OVERRIDES, *overrides]), len(devices))
    row = measure(cfg, devices, steps=steps, warmup=warmup)
    achieved = row["flops"]["plan_useful"] / row["step"]["median_s"]  # per device
    print(f"llama-1b bf16 on {len(devices)} x {kind} ({row['mesh']}): "
          f"step {row['step']['median_s']:.3f} s, {row['tokens_per_s']:,.0f} tokens/s, "
          f"{achieved / 1e12:.1f} TFLOP/s per device, MFU {achieved / peak:.1%} "
          f"(assumed peak: {peak / 1e12:.0f} TFLOP/s dense bf16 per {kind})")
    return 0
