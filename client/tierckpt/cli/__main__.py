"""``python -m tierckpt.cli``: the same as the ``tierckpt`` console script."""

import sys

from . import main

sys.exit(main())
