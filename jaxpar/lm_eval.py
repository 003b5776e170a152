"""The old name of :mod:`jaxpar.evaluation.harness`, kept as documented: ``import jaxpar.lm_eval``
registers lm-eval's model ``jaxpar``, and ``python -m jaxpar.lm_eval`` is lm-eval's command line
with it (docs/evaluation.md, "lm-eval: the model `jaxpar`")."""

from jaxpar.evaluation.harness import DEFAULT_BATCH, JaxparLM, load_generator, main

__all__ = ["DEFAULT_BATCH", "JaxparLM", "load_generator", "main"]

if __name__ == "__main__":
    main()
