"""Text generation without compiling anything: the KV cache's bytes per position, the sampling
options, and ``jaxpar generate``'s help and one-line errors (run in this process). Decoding
itself: ``tests/equivalence/test_generate.py``."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxpar.cli.main import main
from jaxpar.inference.generation import Sampling
from jaxpar.model.kv_cache import cache_bytes_per_token


def test_a_kv_cache_position_costs_the_bytes_the_docstring_says():
    # 2 (k, v) x 2 layers x 4 kv heads x 8 head_dim x 4 bytes
    assert cache_bytes_per_token(2, 4, 8) == 512
    assert cache_bytes_per_token(16, 8, 64, jnp.bfloat16) == 32 * 1024


def test_sampling_options_are_checked():
    for bad in ({"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_generate_help_and_one_line_errors(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0 and "--prompts-file" in capsys.readouterr().out
    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("jaxpar: error: ") and "nowhere" in err[0]
    for bad in (["--prompt", "x", "--max-tokens", "0"], ["--prompt", "x", "--bogus"], []):
        with pytest.raises(SystemExit) as done:
            main(["generate", str(tmp_path), *bad])
        err = capsys.readouterr().err.splitlines()
        assert done.value.code == 2 and len(err) == 1 and err[0].startswith("jaxpar: error:")
