"""Code for each parallelism: :mod:`.rules` (logical-to-mesh axes), :mod:`.zero`,
:mod:`.context`, :mod:`.expert`, :mod:`.pipeline`, :mod:`.manual` (axes split by hand),
:mod:`.hooks` (installing them into the model)."""
