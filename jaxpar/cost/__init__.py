"""The analytic cost model: what a config costs per device, from the config alone (no jax
backend, no compile). :mod:`.params` (each parameter's bytes and split), :mod:`.shapes` (the
sizes a step works on), :mod:`.ledger` and :mod:`.communication` / :mod:`.pipeline` (the bytes each
parallelism moves), :mod:`.memory` (peak memory), :mod:`.estimate` (all of it with flops and step
time on a :mod:`jaxpar.hardware` profile), :mod:`.plan` (``jaxpar plan`` and ``--search``).
It describes the layers below it and is imported by none of them."""
