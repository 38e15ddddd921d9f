"""`python -m server serve ...` runs the same CLI as the `weir` command."""

import sys

from server.cli import main

sys.exit(main())
