"""scripts/wheel_cache.py: the Horovod wheel's cache (outside the clone) trusts an entry only
whole; a corrupt, half-written or unrecorded one is removed so that the build runs again."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "wheel_cache.py"


def _wheel(tmp_path: Path, name="horovod-0.28.1-cp311-cp311-linux_x86_64.whl") -> Path:
    path = tmp_path / "dist" / name
    path.parent.mkdir(exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("horovod/__init__.py", "__version__ = '0.28.1'\n" + "# pad\n" * 5000)
    return path


def _cache(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)],
                          capture_output=True, text=True)


def test_a_stored_wheel_is_found_and_kept(tmp_path):
    cache = tmp_path / "cache" / "horovod-0.28.1" / "key"
    stored = Path(_cache("store", _wheel(tmp_path), cache).stdout.strip())
    assert stored.parent == cache and stored.with_name(stored.name + ".sha256").exists()
    found = _cache("find", cache)
    assert found.returncode == 0 and Path(found.stdout.strip()) == stored
    assert sorted(p.name for p in cache.iterdir()) == [stored.name, stored.name + ".sha256"]


@pytest.mark.parametrize("damage", ["truncated", "flipped", "no checksum", "temporary only"])
def test_a_damaged_entry_is_removed_not_trusted(tmp_path, damage):
    cache = tmp_path / "cache"
    stored = Path(_cache("store", _wheel(tmp_path), cache).stdout.strip())
    data = stored.read_bytes()
    if damage == "truncated":  # a copy cut short
        stored.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":  # same length, one byte changed
        stored.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "no checksum":  # killed between the wheel and its record
        stored.with_name(stored.name + ".sha256").unlink()
    else:  # killed during the copy: only the temporary file is there
        stored.rename(cache / f".{stored.name}.123.tmp")
        stored.with_name(stored.name + ".sha256").unlink()
    found = _cache("find", cache)
    assert found.returncode == 1 and found.stdout == ""
    assert "removing" in found.stderr
    assert list(cache.iterdir()) == []  # the build starts from an empty entry


def test_a_record_that_lies_is_caught_by_the_checksum(tmp_path):
    """A sound zip whose checksum record names other bytes is not used."""
    cache = tmp_path / "cache"
    stored = Path(_cache("store", _wheel(tmp_path), cache).stdout.strip())
    stored.with_name(stored.name + ".sha256").write_text("0" * 64 + "  x.whl\n")
    assert _cache("find", cache).returncode == 1


def test_a_missing_cache_is_no_error(tmp_path):
    found = _cache("find", tmp_path / "nothing-here")
    assert found.returncode == 1 and found.stderr == ""


def test_the_makefile_keeps_the_cache_outside_the_clone(tmp_path):
    """`make` resolves CACHE to the user cache (CGX_CACHE_DIR, else XDG_CACHE_HOME/cgx, else
    ~/.cache/cgx), never to a folder of the checkout."""
    root = SCRIPT.parents[1]

    def cache_dir(**env):
        base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}
        out = subprocess.run(["make", "-s", "-C", str(root), "-n", "horovod"],
                             capture_output=True, text=True, env={**base, **env})
        line = next(l for l in out.stdout.splitlines() if "build-horovod.sh" in l)
        return line.split()[-1]

    assert cache_dir() == f"{tmp_path}/home/.cache/cgx/wheels"
    assert cache_dir(XDG_CACHE_HOME="/x/cache") == "/x/cache/cgx/wheels"
    assert cache_dir(CGX_CACHE_DIR="/y/cgx-cache") == "/y/cgx-cache/wheels"
