"""What a layer keeps for its backward pass: ``train.remat`` and ``train.remat_every``.

A policy keeps fewer intermediates than autodiff (``none``); the backward pass recomputes the rest
from the layer's input. ``full`` keeps nothing else, ``dots`` the weight matmuls' outputs,
``attention`` what attention reads and writes (:data:`ATTENTION_SAVED`), ``offload_dots`` what
``dots`` keeps, in host memory. ``remat_every = k`` applies the policy to one unit in k. Details:
docs/memory.md, "Remat policies".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxpar.config import TrainConfig

# Names the model gives the tensors ``remat=attention`` keeps.
ATTENTION_INPUTS = "attention_inputs"  # q, k, v as the attention kernel reads them
ATTENTION_OUTPUT = "attention_output"  # the kernel's output, the output projection's input
ATTENTION_BRANCH = "attention_branch"  # the projected output, added to the residual stream
ATTENTION_SAVED = (ATTENTION_INPUTS, ATTENTION_OUTPUT, ATTENTION_BRANCH)

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names(*ATTENTION_SAVED),
    "offload_dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst="pinned_host"),
}


def named(name: str, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """``xs`` tagged ``name`` for the policies that select by name (else the identity)."""
    return tuple(checkpoint_name(x, name) for x in xs)


def rematted(fn: Callable, remat: str) -> Callable:
    """``fn`` (one scanned unit) under ``remat``'s policy; ``fn`` itself for ``none``."""
    policy = REMAT_POLICIES[remat]
    return fn if policy is None else jax.checkpoint(fn, policy=policy, prevent_cse=False)


@dataclass(frozen=True)
class Remat:
    """``train.remat`` and ``train.remat_every``: the policy of one unit in ``every``.

    The other units keep everything.
    """

    policy: str = "none"
    every: int = 1

    @classmethod
    def of(cls, remat: Remat | str) -> Remat:
        return remat if isinstance(remat, Remat) else cls(remat)

    @classmethod
    def of_train(cls, train: TrainConfig) -> Remat:
        """The config's ``train.remat`` and ``train.remat_every``."""
        return cls(train.remat, train.remat_every)
