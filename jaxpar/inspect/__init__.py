"""What the compiler made of a step, per device, without running it: :mod:`.report`
(``jaxpar inspect``), :mod:`.hlo` (reading the optimized HLO: collectives, flops, buffers),
:mod:`.compare` (compiled against :mod:`jaxpar.cost`'s plan), :mod:`.tpu` (compiling for a TPU
slice on this machine), :mod:`.dump` (any HLO dump), :mod:`.real_size` (the real-size matrix)."""
