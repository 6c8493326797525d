"""``python -m kvlab``: runs :func:`kvlab.cli.main` and exits with its status. Touches nothing itself."""
import sys

from kvlab.cli import main

if __name__ == "__main__":          # not in `all --jobs`' spawned workers (they import, never run, this module)
    sys.exit(main())
