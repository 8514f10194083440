"""``python -m slurmclock ...``: the same as the ``slurmclock`` command."""

import sys

from slurmclock.cli import main

sys.exit(main())
