"""The suite's own set-up: the modules conftest.py runs alone exist."""

from pathlib import Path

from conftest import SERIAL_MODULES


def test_every_serial_module_exists():
    here = Path(__file__).parent
    names = {p.name for p in here.rglob("test_*.py")}
    assert SERIAL_MODULES <= names, sorted(SERIAL_MODULES - names)
