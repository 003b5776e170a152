"""Pipeline step time against the 1-device step, on virtual CPU devices, in one run.

On virtual CPU devices the same cores do every device's work, so a layout that adds no
redundant work takes about the 1-device step time; a pipeline executes its masked slots too, so
its honest target is the 1-device step times its executed-work factor (``jaxpar schedule``
prints it; (m+p-1)/m for 1F1B). This script prints, per layout, the median step time, the ratio
to the 1-device step, the factor, and the ratio divided by the factor (1.00 = no overhead
beyond the masked slots; the acceptance bound is 1.10).

    python scripts/pipeline_speed.py            # the model of the acceptance test (a few minutes)
    python scripts/pipeline_speed.py --quick    # a smaller model, for a smoke run
    python scripts/pipeline_speed.py --pairs    # zero bubble and DualPipe-V beside 1F1B

``--pairs`` times schedules side by side on one layout (p=4, m=8, the same remat): each timed
step of the one is followed by a step of the other, so both come from the same minutes of the
machine, and prints the ratio of their median step times beside the ratio of their ticks, in
stages' units (zero bubble / 1F1B: 30/33 = 0.91; the acceptance bound is 0.97).
"""

from __future__ import annotations

import argparse
import os
import statistics

DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from bench_timing import Stepper, random_batch, step_times  # noqa: E402

from jaxpar.config import load_config, validate  # noqa: E402
from jaxpar.mesh import make_mesh  # noqa: E402
from jaxpar.parallel.pipeline.executor import describe_config  # noqa: E402
from jaxpar.train.step import build_trainer  # noqa: E402

MODEL = ["model.d_model=256", "model.d_ff=1024", "model.n_layers=4", "model.n_heads=8",
         "model.n_kv_heads=8", "train.seq_len=256", "train.batch_size=16", "train.remat=full",
         "train.dtype=float32"]
QUICK = ["model.d_model=128", "model.d_ff=512", "model.n_layers=4", "train.seq_len=128",
         "train.batch_size=16", "train.remat=full"]
LAYOUTS = [(f"{s} pipe={p} data={8 // p} m={m}",
            [f"mesh.pipe={p}", f"mesh.data={8 // p}", f"train.microbatches={m}",
             f"parallel.pipeline_schedule={s}"])
           for p, m in [(2, 4), (4, 8)] for s in ("gpipe", "1f1b", "zero_bubble")]


def step_seconds(overrides: list[str], devices: int, steps: int) -> float:
    """Median wall time of a train step after compiling and two warm-up steps."""
    cfg = validate(load_config("tiny", overrides), devices)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:devices]))
    batch = random_batch(cfg, trainer)
    times, _ = step_times(trainer.compile_step(), trainer.init(), batch, warmup=2, steps=steps)
    return statistics.median(times)


# (schedule, virtual stages) against (schedule, virtual stages), at p=4 and m=8 on 8 devices.
PAIRS = [(("zero_bubble", 1), ("1f1b", 1)), (("zero_bubble", 2), ("interleaved", 2)),
         (("dualpipe_v", 2), ("1f1b", 1))]


def _stepper(overrides: list[str]) -> tuple[Stepper, dict]:
    cfg = validate(load_config("tiny", overrides), DEVICES)
    trainer = build_trainer(cfg, make_mesh(cfg, devices=jax.devices()[:DEVICES]))
    info = describe_config(cfg)
    return Stepper(trainer.compile_step(), trainer.init(), random_batch(cfg, trainer)), info


def pairs(model: list[str], steps: int) -> float:
    """Each pair's step-time ratio beside its tick ratio; returns zero bubble / 1F1B's."""
    layout = ["mesh.pipe=4", "mesh.data=2", "train.microbatches=8", "model.n_layers=8"]
    print(f"{'schedule':<16} {'beside':<14} {'s/step':>7} {'s/step':>7} {'time':>6} {'ticks':>9}")
    first = 0.0
    for (name, v), (other, w) in PAIRS:
        a, info_a = _stepper([*model, *layout, f"parallel.pipeline_schedule={name}",
                              f"parallel.virtual_stages={v}"])
        b, info_b = _stepper([*model, *layout, f"parallel.pipeline_schedule={other}",
                              f"parallel.virtual_stages={w}"])
        times, _ = step_times(a.step, a.state, a.batch, warmup=2, steps=steps, alongside=b)
        ratio = statistics.median(times) / statistics.median(b.times)
        first = first or ratio
        # Ticks in stages' units (a chunk tick is 1/v of one), so that v = 1 and 2 compare.
        a_ticks = info_a["ticks"] / info_a["virtual_stages"]
        b_ticks = info_b["ticks"] / info_b["virtual_stages"]
        ticks = f"{a_ticks:g}/{b_ticks:g} = {a_ticks / b_ticks:.3f}"
        print(f"{name + f' v={v}':<16} {other + f' v={w}':<14} {statistics.median(times):7.3f} "
              f"{statistics.median(b.times):7.3f} {ratio:6.3f} {ticks:>9}", flush=True)
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    parser.add_argument("--pairs", action="store_true", help="zero bubble and DualPipe-V "
                        "beside 1F1B and interleaved, step by step (module docstring)")
    args = parser.parse_args()
    model = QUICK if args.quick else MODEL
    if args.pairs:
        ratio = pairs([m for m in model if not m.startswith("model.n_layers")], args.steps)
        print(f"zero bubble / 1F1B step time: {ratio:.3f} "
              f"({'within' if ratio <= 0.97 else 'above'} the 0.97 bound)")
        return 0
    base = step_seconds([*model, "mesh.data=1"], 1, args.steps)
    print(f"1 device: {base:.3f} s/step")
    print(f"{'layout':<28} {'s/step':>7} {'/1-dev':>7} {'factor':>7} {'/factor':>8}")
    worst = 0.0
    for name, layout in LAYOUTS:
        seconds = step_seconds([*model, *layout], DEVICES, args.steps)
        cfg = validate(load_config("tiny", [*model, *layout]), DEVICES)
        factor = describe_config(cfg)["executed_work_factor"]
        ratio = seconds / base
        worst = max(worst, ratio / factor)
        print(f"{name:<28} {seconds:7.3f} {ratio:7.2f} {factor:7.3f} {ratio / factor:8.2f}",
              flush=True)
    print(f"worst step time / (1-device step x executed-work factor): {worst:.2f} "
          f"({'within' if worst <= 1.10 else 'above'} the 1.10 bound)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
