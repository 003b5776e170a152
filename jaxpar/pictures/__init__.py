"""Every figure jaxpar draws (matplotlib): :mod:`.figures` (``inspect --png``, ``schedule --png``),
:mod:`.mesh_panel`, :mod:`.schedule_table`, :mod:`.tables`, :mod:`.style`."""
