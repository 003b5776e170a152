"""Scoring a checkpoint: :mod:`.split_loss` (``jaxpar eval``), :mod:`.harness` (lm-eval's model)."""
