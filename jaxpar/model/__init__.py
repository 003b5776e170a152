"""The transformer, knowing nothing of meshes: its arrays name logical axes.

:mod:`jaxpar.parallel.rules` maps them to mesh axes; the parallel code plugs in through
:mod:`.annotate`'s hooks.
"""
