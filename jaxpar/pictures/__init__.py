"""Every figure jaxpar draws (matplotlib): :mod:`.figures` (``inspect --png``, ``schedule --png``),
:mod:`.mesh`, :mod:`.schedule`, :mod:`.tables`, :mod:`.style`."""
