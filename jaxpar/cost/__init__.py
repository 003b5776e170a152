"""The analytic cost model: what a config costs per device, from the config alone (no jax
backend, no compile): :mod:`.params`, :mod:`.shapes`, :mod:`.ledger`, :mod:`.communication`,
:mod:`.pipeline`, :mod:`.memory`, :mod:`.estimate` (with flops and step time on a
:mod:`jaxpar.hardware` profile), :mod:`.plan` (``jaxpar plan``). No layer below imports it."""
