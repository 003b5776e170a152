"""The ``jaxpar`` command line: :mod:`.main` parses and dispatches, one module per command
(:mod:`.train`, :mod:`.inspect`, :mod:`.plan`, :mod:`.schedule`, :mod:`.hf` for ``export`` and
``import-hf``, :mod:`.generate`, :mod:`.tokenize`), :mod:`.common` what they share.
``python -m jaxpar.cli`` runs it."""
