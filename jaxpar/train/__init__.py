"""Training: :mod:`.step` (the jitted train step on a mesh), :mod:`.loop` (data, checkpoints,
logging around it), :mod:`.init_from` (starting from another checkpoint's weights),
:mod:`.metrics`, :mod:`.observe` (TensorBoard, profiles), :mod:`.compiled` (a step compiled
without running it, for ``inspect``)."""
