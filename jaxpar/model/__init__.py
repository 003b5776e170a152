"""The transformer, knowing nothing of meshes: its arrays name logical axes (``embed``,
``heads``, ``seq``, ...) that :mod:`jaxpar.parallel.rules` maps to mesh axes, and the parallel
code plugs in through the hooks of :mod:`.annotate`."""
