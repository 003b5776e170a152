"""Checkpoints: a run's orbax train state with a checksum per array, and its weights alone.

:mod:`.state` and :mod:`.integrity` save and verify; :mod:`.weights_only` and :mod:`.weights` read
weights without a mesh (also ``jaxpar export``'s flat format).
"""
