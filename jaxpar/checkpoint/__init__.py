"""Checkpoints: a run's orbax train state with a checksum per array (:mod:`.state`,
:mod:`.integrity`), weights-only checkpoints and reading a checkpoint's weights without a mesh
(:mod:`.weights_only`, :mod:`.weights`: also ``jaxpar export``'s flat format)."""
