"""``jaxpar export ... --format hf --adapters-only``: a LoRA run's adapters as a PEFT directory.

Writes ``adapter_config.json`` and ``adapter_model.safetensors``. ``W_hf + (lora_alpha / r) lora_B
lora_A`` is the merged weight: :func:`jaxpar.hf.names.to_hf` flattens heads in the order used here.
The files: docs/lora.md, "Export".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxpar.checkpoint.state import read_config
from jaxpar.checkpoint.weights_only import read_weights, step_dir
from jaxpar.config import ConfigError, config_from_dict
from jaxpar.hf.config import hf_config_from_model
from jaxpar.hf.names import hf_tensors
from jaxpar.model.lora import FEED_FORWARD, PREFIX, TARGETS

PEFT_PREFIX = "base_model.model."


def adapter_tensors(cfg, params: dict) -> dict[str, np.ndarray]:
    """PEFT's tensors of a LoRA run's parameters (``cfg``: the run's config)."""
    lora = cfg.train.lora
    by_weight = {(part, attr): target for target, (part, attr, _, _) in TARGETS.items()
                 if target in lora.targets}
    out = {}
    for t in hf_tensors(cfg.model):
        if len(t.path) != 3 or t.path[0] != "layers" or tuple(t.path[1:]) not in by_weight:
            continue
        part, _ = t.path[1:]
        adapter = params["layers"][part][PREFIX + by_weight[tuple(t.path[1:])]]
        a = np.asarray(adapter["a"][t.index], np.float32)  # [*in, r]
        b = np.asarray(adapter["b"][t.index], np.float32)  # [r, *out]
        module = PEFT_PREFIX + t.hf.removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, lora.rank).T)
        out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(lora.rank, -1).T)
    return out


def check_exportable(cfg) -> None:
    """Refuse (one line) adapters PEFT's directory cannot name yet (docs/lora.md, "Export").

    A MoE model's routed experts; the blocks of a MoE model with dense blocks.
    """
    lora, moe = cfg.train.lora, cfg.model.moe
    if not moe.enabled:
        return
    experts = [t for t in lora.targets if t in FEED_FORWARD]
    if experts:
        raise ConfigError(f"--adapters-only: targets {', '.join(experts)} adapt a "
                          "mixture-of-experts model's routed experts, which PEFT's adapter "
                          "directory cannot name yet; export the merged model (drop "
                          "--adapters-only)")
    if moe.every > 1 or moe.first_dense > 0:
        raise ConfigError("--adapters-only: a mixture-of-experts model with dense blocks "
                          "(model.moe.every > 1 or first_dense > 0) is not supported yet; "
                          "export the merged model (drop --adapters-only)")


def export_adapters(source: Path, out_dir: Path) -> tuple[Path, int]:
    """Write the PEFT directory of LoRA checkpoint ``source``; returns the weights file and step."""
    path = step_dir(source)
    cfg = config_from_dict(read_config(path))
    lora = cfg.train.lora
    if lora.rank == 0:
        raise ConfigError(f"--adapters-only: checkpoint {path} has no LoRA adapters "
                          "(train.lora.rank is 0 in its run)")
    hf_config_from_model(cfg.model)  # refuses a model transformers has no class for
    check_exportable(cfg)
    params, _, step = read_weights(path)
    tensors = adapter_tensors(cfg, params)
    modules = sorted({name.split(".")[-3] for name in tensors})
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "adapter_model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "modules_to_save": None, "inference_mode": True, "init_lora_weights": True,
              "base_model_name_or_path": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return weights, step


def export_adapters_main(source: Path, out_dir: Path) -> int:
    weights, step = export_adapters(source, out_dir.expanduser())
    print(f"exported the LoRA adapters of step {step} in PEFT's format: {weights} and "
          f"adapter_config.json")
    return 0
