"""Run by tests/integration/test_multiprocess.py under ``scripts/launch_local.py``: a few train
steps of CONFIG (with ``key=value`` overrides) on a mesh whose innermost axis pairs devices of
different processes, printing (process 0) one JSON line: the losses, and the processes of every
group of devices along the innermost axis.

    python tests/multiprocess_losses.py STEPS CONFIG [key=value ...]

The CLI builds the mesh from ``jax.devices()`` in process order, which keeps an inner axis such as
``tensor`` inside one process; interleaving the processes' devices puts it across them instead.
"""

from __future__ import annotations

import json
import sys


def interleaved_devices(devices: list) -> list:
    """Device k of every process next to device k of the others: [p0d0, p1d0, p0d1, p1d1, ...]
    (one process: the same order)."""
    by_process: dict[int, list] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    return [device for group in zip(*by_process.values(), strict=True) for device in group]


def main(argv: list[str]) -> None:
    from jaxpar.config import load_config, validate
    from jaxpar.distributed import start_distributed
    from jaxpar.mesh import device_count, make_mesh, use_host_devices

    steps, cfg = int(argv[0]), load_config(argv[1], argv[2:])
    use_host_devices(cfg.host_devices)
    start_distributed(cfg.distributed)
    cfg = validate(cfg, device_count(cfg))

    import jax

    from jaxpar.train.loop import make_data_iterator
    from jaxpar.train.step import build_trainer

    mesh = make_mesh(cfg, devices=interleaved_devices(jax.devices()))
    inner = mesh.devices.reshape(-1, mesh.devices.shape[-1])
    trainer = build_trainer(cfg, mesh)
    data = make_data_iterator(cfg)[0].with_rows(trainer.local_batch_rows())
    state, losses = trainer.init(), []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put_batch(next(data)))
        losses.append(float(metrics["loss"]))
    if jax.process_index() == 0:
        print(json.dumps({"losses": losses, "rows": trainer.local_batch_rows().tolist(),
                          "inner_axis_processes": [[d.process_index for d in group]
                                                   for group in inner]}))


if __name__ == "__main__":
    main(sys.argv[1:])
