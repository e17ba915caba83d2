"""A cache of built wheels that trusts an entry only whole (scripts/build-horovod.sh uses it).

    python scripts/wheel_cache.py find DIR      # prints the sound wheel in DIR, exit 1 if none
    python scripts/wheel_cache.py store WHEEL DIR   # copies WHEEL into DIR, then its checksum

An entry is the wheel and, written after it, ``<wheel>.sha256``. ``find`` returns a wheel only
when its checksum file exists and agrees and the wheel is a sound zip; anything else found
in DIR (a copy cut short by a full disk or a kill, a wheel without its checksum, a
checksum without its wheel, a temporary file) is removed, and says so on stderr, so that
the caller builds again. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Optional


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sound(wheel: Path) -> bool:
    """Is ``wheel`` whole: its recorded checksum agrees and every member reads back?"""
    record = wheel.with_name(wheel.name + ".sha256")
    try:
        if record.read_text().split()[0] != sha256(wheel):
            return False
        with zipfile.ZipFile(wheel) as z:
            return z.testzip() is None
    except (OSError, IndexError, zipfile.BadZipFile):
        return False


def find(directory: Path) -> Optional[Path]:
    """The sound wheel in ``directory``; every other entry there is removed."""
    if not directory.is_dir():
        return None
    wheels = sorted(directory.glob("*.whl"))
    found = next((w for w in wheels if sound(w)), None)
    for path in directory.iterdir():
        if found is not None and path in (found, found.with_name(found.name + ".sha256")):
            continue
        print(f"wheel cache: removing {path} (corrupt, half-written or without its "
              f"checksum)", file=sys.stderr)
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return found


def store(wheel: Path, directory: Path) -> Path:
    """Copy ``wheel`` into ``directory`` (atomically), then record its checksum."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / wheel.name
    tmp = directory / f".{wheel.name}.{os.getpid()}.tmp"
    shutil.copyfile(wheel, tmp)
    os.replace(tmp, target)
    record = directory / f".{wheel.name}.sha256.{os.getpid()}.tmp"
    record.write_text(f"{sha256(target)}  {target.name}\n")
    os.replace(record, target.with_name(target.name + ".sha256"))
    return target


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "find":
        found = find(Path(argv[1]))
        if found is None:
            return 1
        print(found)
        return 0
    if len(argv) == 3 and argv[0] == "store":
        print(store(Path(argv[1]), Path(argv[2])))
        return 0
    print("\n".join(__doc__.splitlines()[2:4]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
