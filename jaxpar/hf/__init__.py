"""Hugging Face checkpoints in and out: configs, names and layouts, import and export.

:mod:`.config` maps ``config.json``, :mod:`.names` the tensors; :mod:`.importer` is ``jaxpar
import-hf``, :mod:`.exporter` ``jaxpar export --format hf``.
"""
