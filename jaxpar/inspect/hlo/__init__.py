"""Reading optimized HLO text: instructions and trip counts, replica groups, collectives, flops,
buffers.

:mod:`.text`, :mod:`.groups`, :mod:`.collectives`, :mod:`.flops`, :mod:`.buffers`.
"""
