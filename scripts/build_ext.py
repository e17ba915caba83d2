"""Rebuild cgx's C extension in place (``make ext``); quiet unless it fails."""

import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                      cwd=root, capture_output=True, text=True)
if proc.returncode != 0:
    sys.stderr.write(proc.stdout + proc.stderr)
    sys.exit(proc.returncode)
