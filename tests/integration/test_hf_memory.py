"""``jaxpar import-hf`` holds the model once: the resident memory it adds, measured in a fresh
process on a ~100 MB model, stays below 1.5 x the model's float32 bytes.

The measure is the kernel's high-water mark of resident memory (``VmHWM``), reset just before
the import (``/proc/self/clear_refs``), minus the resident memory then. It counts everything
the process touches: numpy arrays, orbax's and tensorstore's buffers, and the pages of the
safetensors files it maps (file-backed pages count as resident while mapped). Reading the
weights and then converting them, or mapping every file for the whole import, would each
hold a second copy: 2x and more, which the 1.5x bound rejects.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

MEASURE = """
import gc, json, sys
from pathlib import Path
from jaxpar.hf.importer import import_hf

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

root = Path(sys.argv[1])
import_hf(root / "warm", root / "warm-out")  # load every code path first
gc.collect()
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
done = import_hf(root / "big", root / "big-out")
print(json.dumps({"added": status("VmHWM") - before, "model": done.total_bytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_import_adds_less_than_one_and_a_half_models_of_memory(tmp_path):
    import torch
    from hf_models import save_hf_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    big = LlamaForCausalLM(LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4))
    big.save_pretrained(tmp_path / "big", max_shard_size="60MB")  # two shards and an index
    del big
    save_hf_model("llama", tmp_path / "warm")
    # The smaller of two measurements: on a loaded machine one import's high-water mark has read
    # 1.55x where the same code reads 1.22-1.40x on a quiet one; a second copy of the model
    # (2x and more) fails both.
    runs = []
    for _ in range(2):
        for out in ("warm-out", "big-out"):
            shutil.rmtree(tmp_path / out, ignore_errors=True)
        result = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    measured = min(runs, key=lambda m: m["added"])
    assert measured["model"] > 90e6
    ratio = measured["added"] / measured["model"]
    print(f"import added {measured['added'] / 1e6:.0f} MB for a {measured['model'] / 1e6:.0f} MB "
          f"model: {ratio:.2f}x (runs: {[m['added'] for m in runs]})")
    assert ratio < 1.5, runs
