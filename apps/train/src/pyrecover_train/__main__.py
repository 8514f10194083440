"""``python -m pyrecover_train`` = ``pyrecover-train``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
