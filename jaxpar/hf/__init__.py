"""Hugging Face checkpoints in and out: :mod:`.config` (their ``config.json`` <-> jaxpar's model
config), :mod:`.names` (parameter names and layouts), :mod:`.importer` (``jaxpar import-hf``:
a weights-only checkpoint) and :mod:`.exporter` (``jaxpar export --format hf``)."""
