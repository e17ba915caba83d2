"""Deprecated import path of the ``cgxrun`` launcher: use :mod:`cgx.launch.cli`.

Kept for one release so that ``python -m cgx.run`` and scripts importing
``cgx.run`` keep working; the console script ``cgxrun`` points at
``cgx.launch.cli:main``.
"""

import sys

from cgx.launch.cli import *  # noqa: F401,F403
from cgx.launch.cli import main
from cgx.launch.exit_record import (RECORD_FLAG, default_signals,  # noqa: F401
                                    first_recorded_failure)

if __name__ == "__main__":
    sys.exit(main())
