"""``python -m narwhal.tools.mock``: the mock engine without the narwhal CLI in front."""

import sys

from narwhal.tools.mock.engine import main

raise SystemExit(main(sys.argv[1:]))
