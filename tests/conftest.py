"""Shared pytest set-up of the cgx test suite.

Triton kernels need a CUDA device. Without one, the tests run them under
Triton's CPU interpreter (slow: ~ms per program, so Triton tests use small
inputs). Triton decides between compiling and interpreting when a kernel is
*decorated*, i.e. when ``cgx.kernels.quantize`` is first imported, reading
``TRITON_INTERPRET`` then; conftest.py is imported before any test module, so
setting the variable here is early enough. An explicit TRITON_INTERPRET in the
environment wins.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def horovodrun() -> str:
    """Path of horovodrun, after checking that Horovod works in this Python."""
    if os.environ.get("CGX_SKIP_HOROVOD_TESTS") == "1":
        pytest.skip("CGX_SKIP_HOROVOD_TESTS=1: Horovod tests skipped on request")
    probe = subprocess.run(
        [sys.executable, "-c",
         "import horovod, horovod.torch as h; print(horovod.__version__, h.gloo_built(), "
         "h.mpi_built())"],
        capture_output=True, text=True, timeout=120)
    exe = Path(sys.executable).parent / "horovodrun"
    if not exe.exists():
        exe = Path(shutil.which("horovodrun") or exe)
    problem = None
    if probe.returncode != 0:
        last_line = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        problem = f"'import horovod.torch' fails: {last_line}"
    elif probe.stdout.split() != ["0.28.1", "True", "True"]:
        problem = f"found horovod/gloo/mpi = {probe.stdout.strip()}, expected 0.28.1 True True"
    elif not exe.exists():
        problem = f"horovodrun not found next to {sys.executable} nor on PATH"
    if problem:
        pytest.fail(f"Horovod 0.28.1 is not usable in {sys.executable}: {problem}. Run "
                    f"`make horovod` (scripts/build-horovod.sh) to build it, or set "
                    f"CGX_SKIP_HOROVOD_TESTS=1 to skip the Horovod tests on purpose.",
                    pytrace=False)
    return str(exe)


# Modules whose tests assert timing (overlap with backward, stall and drift detection,
# measured link rates): `make test` runs them alone, after the parallel part
# (pytest-xdist), so that no neighbouring test takes their cores.
SERIAL_MODULES = frozenset({
    "test_torch_optimizer.py", "test_sufficient_factors.py", "test_tensorflow_overlap.py",
    "test_netsim.py", "test_reliability.py", "test_reliability_keras.py",
    "test_observability.py", "test_planned_mode.py", "test_calibration.py",
    "test_auto_world.py", "test_deciding_netsim.py", "test_deciding_mode.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
    # Modules that start real ranks first, each module's tests kept together and in order:
    # the workers (`make test` runs them with --dist worksteal) then end on short tests,
    # not with one worker idle while the other runs a minute-long one.
    multi = {item.path for item in items if item.get_closest_marker("multiproc")}
    items.sort(key=lambda item: item.path not in multi)
