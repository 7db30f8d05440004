"""``python -m narwhal.mock``: the mock engine without the narwhal CLI in front."""

import sys

from narwhal.mock.engine import main

raise SystemExit(main(sys.argv[1:]))
