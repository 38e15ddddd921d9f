"""`python -m server serve ...` runs the same CLI as the `weir` command."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
