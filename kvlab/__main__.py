"""``python -m kvlab``: runs :func:`kvlab.cli.main` and exits with its status. Touches nothing itself."""
import sys

from kvlab.cli import main

sys.exit(main())
