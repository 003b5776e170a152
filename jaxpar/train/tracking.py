"""A Weights & Biases run beside ``metrics.jsonl`` (``logging.wandb``).

It holds each row's scalars at its ``step``, ``config.yaml`` as config, and a summary with the
mesh, layout and ``jaxpar plan``'s prediction (:func:`jaxpar.cli.train.plan_summary`).
Process 0 writes it; a resumed run continues it (id in ``run_dir/wandb_run_id``). An
unreachable server warns once and the run goes on; a missing package is a config error
(:func:`require_wandb`). Details: docs/configuration.md.
"""

from __future__ import annotations

import importlib.util
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import yaml

from jaxpar.config import Config, ConfigError

RUN_ID_FILE = "wandb_run_id"
# The cost model's headline numbers of a config (jaxpar.cli.train.plan_summary): passed in, as
# nothing in train imports the cost model.
PlanFn = Callable[[Config], Mapping[str, Any]]
WANDB_DIR = "wandb"  # wandb's own folder, under run_dir


def require_wandb(cfg: Config) -> None:
    """With ``logging.wandb.mode`` online or offline, wandb must be there (checked on every
    process first): process 0 imports it, the others only look for it."""
    mode = cfg.logging.wandb.mode
    if mode == "disabled":
        return
    try:
        if jax.process_index() == 0:
            import wandb  # noqa: F401, PLC0415  (optional extra)
        elif importlib.util.find_spec("wandb") is None:
            raise ImportError("no wandb")
    except (ImportError, ValueError):  # ValueError: find_spec of a half-imported module
        raise ConfigError(f"logging.wandb.mode={mode} needs wandb: pip install 'jaxpar[track]' "
                          "(or set logging.wandb.mode=disabled)") from None


def layout_summary(cfg: Config, device_kind: str) -> dict[str, Any]:
    """The run's mesh and layout, flat, for the W&B summary."""
    out: dict[str, Any] = {f"mesh/{axis}": size for axis, size in cfg.mesh_shape.items()}
    out.update({"layout/zero": cfg.parallel.zero,
                "layout/sequence_parallel": cfg.parallel.sequence_parallel,
                "layout/remat": cfg.train.remat, "layout/dtype": cfg.train.dtype,
                "layout/devices": jax.device_count(), "layout/device_kind": device_kind})
    if cfg.mesh.pipe > 1:
        out["layout/pipeline_schedule"] = cfg.parallel.pipeline_schedule
    return out


class WandbRun:
    """The W&B run on process 0: :meth:`open`, :meth:`log` per row, :meth:`close` however the
    run ends."""

    def __init__(self, run: Any, say: Callable[[str], None]):
        self.run = run
        self.say = say

    @classmethod
    def open(cls, cfg: Config, first_step: int, say: Callable[[str], None],
             plan: PlanFn | None = None) -> tuple[WandbRun | None, str | None]:
        """The run (None: not asked for, not process 0, or server unreachable) and a console
        line (None: nothing to say). ``plan``: ``jaxpar plan``'s prediction, asked once the run
        started."""
        w = cfg.logging.wandb
        if w.mode == "disabled" or jax.process_index() != 0:
            return None, None
        import wandb  # noqa: PLC0415  (optional extra; require_wandb checked it is there)

        run_dir = Path(cfg.run_dir)
        id_file = run_dir / RUN_ID_FILE
        # A fresh start (step 1) is a new W&B run, as it starts metrics.jsonl over.
        resumed = first_step > 1 and id_file.is_file()
        run_id = id_file.read_text().strip() if resumed else secrets.token_hex(4)  # W&B-style
        id_file.write_text(run_id + "\n")
        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        try:
            run = wandb.init(
                project=w.project, entity=w.entity, name=w.name, group=w.group,
                tags=list(w.tags) or None, mode=w.mode, dir=str(run_dir), id=run_id,
                resume="allow", config=yaml.safe_load((run_dir / "config.yaml").read_text()),
                # console off: wandb would wrap stdout under the progress bar; the log lines
                # are the metrics anyway.
                settings=wandb.Settings(init_timeout=w.init_timeout_s, console="off"))
            run.define_metric("step")
            run.define_metric("*", step_metric="step")  # re-logged steps land on their own x
            run.summary.update({**layout_summary(cfg, jax.devices()[0].device_kind),
                                **(plan(cfg) if plan is not None else {})})
        except Exception as err:  # noqa: BLE001  (any failure of the tracker: train untracked)
            return None, (f"logging.wandb: no W&B run ({type(err).__name__}: "
                          f"{_first_line(err)}); training goes on without it")
        local = Path(run.dir).parent  # wandb's folder of this run (files/ is inside)
        where = (f"in {local}; upload it with: wandb sync {local}" if w.mode == "offline"
                 else run.url or "")
        return cls(run, say), (f"logging.wandb: W&B run {run_id} ({w.mode}"
                               f"{', continued' if resumed else ''}) {where}").rstrip()

    def log(self, step: int, values: dict[str, float]) -> None:
        """One row's scalars at ``step``; W&B's own step counter runs on, so a resumed run's
        repeated steps are accepted."""
        if self.run is None:
            return
        try:
            self.run.log({**values, "step": step})
        except Exception as err:  # noqa: BLE001  (the tracker failing never stops training)
            self.say(f"logging.wandb: logging stopped ({type(err).__name__}: "
                     f"{_first_line(err)}); training goes on without it")
            self.run = None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"
