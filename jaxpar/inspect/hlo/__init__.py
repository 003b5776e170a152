"""Reading optimized HLO text: :mod:`.text` (instructions, computations, loop trip counts),
:mod:`.groups` (replica groups onto mesh axes), :mod:`.collectives` (each collective's kind,
axes and bytes), :mod:`.flops` (matmul flops), :mod:`.buffers` (the largest arrays)."""
