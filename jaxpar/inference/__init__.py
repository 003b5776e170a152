"""Running a trained model: :mod:`.generation` (prefill, KV-cached decoding, sampling, scoring)."""
