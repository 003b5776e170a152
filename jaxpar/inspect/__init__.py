"""What the compiler made of a step, per device, without running it.

:mod:`.report` is ``jaxpar inspect``; :mod:`.hlo` reads the optimized HLO; :mod:`.compare` sets it
beside the plan; :mod:`.tpu` compiles for a TPU slice here; :mod:`.dump` reads any HLO dump;
:mod:`.real_size` is the real-size matrix.
"""
