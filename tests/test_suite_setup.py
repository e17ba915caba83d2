"""The suite's own set-up: the modules conftest.py runs alone exist."""

from pathlib import Path

from conftest import SERIAL_MODULES


def test_every_serial_module_exists():
    here = Path(__file__).parent
    names = {p.name for p in here.rglob("test_*.py")}
    assert SERIAL_MODULES <= names, sorted(SERIAL_MODULES - names)



def _collected(root: Path, expr: str) -> list:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-m", expr],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 5), out.stdout[-2000:] + out.stderr[-2000:]  # 5: none
    return sorted(line for line in out.stdout.splitlines() if "::" in line)


def test_the_fast_tier_is_the_unit_tests_and_one_smoke_per_framework():
    """`make test-fast`'s marker expression (read from the Makefile) picks, of the tests that
    start real ranks, the two smokes only, and nothing that times, needs Horovod or
    namespaces."""
    import re
    root = Path(__file__).resolve().parents[1]
    make = (root / "Makefile").read_text()
    expr = re.search(r'-m "([^"]+)"', make[make.index("\ntest-fast:"):]).group(1)
    # (one collection: the smokes start real ranks, so they are all it may find)
    assert _collected(root, f"({expr}) and (multiproc or serial or horovod or netns or slow "
                            f"or browser)") == [
        "tests/test_equivalence_keras.py::test_keras_patterns_match_the_single_process_reference",
        "tests/test_equivalence_torch.py::test_patterns_match_the_single_process_reference"
        "[2-plain]"]
