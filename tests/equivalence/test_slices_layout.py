"""A mesh over several slices (``mesh.dcn``) is the same layout with its devices arranged
slice by slice: on 8 virtual CPU devices as two slices of 4, ``data=2 fsdp=2 tensor=2`` with
``fsdp`` over the slices gives the one-device loss, gradients and parameters, and the compiled
step's FSDP collectives (each pair of an fsdp group in different slices) are those of the
one-slice layout."""

from __future__ import annotations

import numpy as np
from helpers import assert_grads_and_params_match, run_layout

MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


def test_fsdp_over_two_slices_matches_one_device() -> None:
    ref = run_layout(())
    got = run_layout((*MESH, "mesh.dcn.fsdp=2"))
    ids = np.vectorize(lambda d: d.id)(got["trainer"].mesh.devices).reshape(2, 2, 2)
    # fsdp's outer factor steps between the slices (devices 0-3, 4-7): mesh[d, f, t] = 4f + 2d + t.
    np.testing.assert_array_equal(ids, [[[0, 1], [4, 5]], [[2, 3], [6, 7]]])
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert_grads_and_params_match(got, ref)
    one_slice = run_layout(MESH)
    kinds = lambda r: sorted({(c.kind, c.axes) for c in r["collectives"]})  # noqa: E731
    assert kinds(got) == kinds(one_slice)
    assert ("reduce-scatter", ("fsdp",)) in kinds(got)
