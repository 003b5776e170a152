"""The old name of :mod:`jaxpar.inference.generation`, kept so that ``from jaxpar.generate import
Generator`` (and the other public names) still works."""

from jaxpar.inference.generation import (
    LENGTH_BUCKET,
    SUPPORTED_AXES,
    EosIds,
    Generator,
    Sampling,
    Step,
    check_weights,
    eos_array,
    forward_cached,
    generate,
    generation_config,
    last_logits,
    sample,
)

__all__ = ["LENGTH_BUCKET", "SUPPORTED_AXES", "EosIds", "Generator", "Sampling", "Step",
           "check_weights", "eos_array", "forward_cached", "generate", "generation_config",
           "last_logits", "sample"]
