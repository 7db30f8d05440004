"""``python -m narwhal``: see ``narwhal.cli``."""

import sys

from .cli import main

sys.exit(main())
