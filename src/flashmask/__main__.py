"""``python -m flashmask``: the same command line as the ``flashmask`` script."""

import sys

from flashmask.cli import main

if __name__ == "__main__":
    sys.exit(main())
