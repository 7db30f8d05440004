"""``python -m narwhal``: see ``narwhal.cli``."""

import sys

from narwhal.cli import main

sys.exit(main())
