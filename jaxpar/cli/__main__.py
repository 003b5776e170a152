"""``python -m jaxpar.cli``: the ``jaxpar`` command."""

import sys

from jaxpar.cli.main import main

sys.exit(main())
