#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 for a given Python environment.
#
#   scripts/build-horovod.sh PYTHON WHEEL_CACHE_DIR
#
# 1. If PYTHON already imports horovod 0.28.1 built for its torch and
#    TensorFlow versions, with both controllers (Gloo, MPI), exit at once.
# 2. Else, if WHEEL_CACHE_DIR holds a wheel built for this Python / torch /
#    TensorFlow / MPI / CPU-architecture combination, pip-install it. A cached
#    wheel is used only if it matches the checksum recorded when it was stored
#    and is a sound zip; a corrupt or half-written entry is removed and built again.
# 3. Else download the 0.28.1 sdist from PyPI, patch it so it builds against
#    torch >= 2.1 and recent TensorFlow on CPU (see docs/horovod.md), build a
#    wheel against PYTHON's torch and TensorFlow (Gloo and MPI both compiled
#    in), store it in the cache and install it. About 8 minutes on 2 idle cores.
#
# Environment:
#   HOROVOD_BUILD_JOBS        parallel compile jobs (default: number of CPUs, at most one
#                             per 3 GB of memory: one g++ on Horovod's TF ops peaks at 2.4 GB)
#   HOROVOD_BUILD_ARCH_FLAGS  CPU flags for Horovod's C++ code (default: -mf16c -mavx
#                             -mfma when this CPU has them, else none). Part of the cache key.
set -euo pipefail

HOROVOD_VERSION=0.28.1
# sha256 of horovod-0.28.1.tar.gz as published on PyPI.
SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0

usage() { echo "usage: $0 PYTHON WHEEL_CACHE_DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
PY=$1
CACHE_DIR=$2
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "build-horovod: '$PY' is not an executable Python" >&2
  exit 2
fi
# Absolute, but not symlink-resolved (a venv's python is a symlink to the base one).
case $PY in
  /*) ;;
  */*) PY="$PWD/$PY" ;;
  *) PY=$(command -v "$PY") ;;
esac

mkdir -p "$CACHE_DIR"
CACHE_DIR=$(cd "$CACHE_DIR" && pwd)

START=$SECONDS
say() { printf '[build-horovod +%4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { printf '[build-horovod +%4ds] ERROR: %s\n' "$((SECONDS - START))" "$*" >&2; exit 1; }

# ---- versions and cache key -------------------------------------------------
# (importlib.metadata only: importing torch or TensorFlow here would cost seconds)
read -r PY_TAG TORCH_VERSION TF_VERSION < <("$PY" - <<'EOF' 2>/dev/null
import sys, importlib.metadata as md
def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return "none"
print(f"cp{sys.version_info[0]}{sys.version_info[1]}",
      version("torch"),
      version("tensorflow-cpu", "tensorflow", "tensorflow-intel"))
EOF
) || die "could not read versions from $PY"
[ "$TORCH_VERSION" != none ] || die "torch is not installed in $PY (run 'make install' first)"
[ "$TF_VERSION" != none ] || die "TensorFlow is not installed in $PY (run 'make install' first)"
command -v mpirun >/dev/null 2>&1 \
  || die "mpirun not found: install Open MPI (scripts/install-system-deps.sh)"
MPI_VERSION=$(mpirun --version 2>/dev/null | sed -n 's/.*(Open MPI) \([0-9.]*\).*/ompi\1/p' | head -1)
MPI_VERSION=${MPI_VERSION:-mpi-unknown}
ARCH=$(uname -m)
if [ -z "${HOROVOD_BUILD_ARCH_FLAGS+x}" ]; then
  # A fixed value (not Horovod's -march=native probe) so that a cached wheel
  # does not depend on which machine built it.
  HOROVOD_BUILD_ARCH_FLAGS=""
  if [ "$ARCH" = x86_64 ] && grep -qw avx /proc/cpuinfo && grep -qw f16c /proc/cpuinfo \
      && grep -qw fma /proc/cpuinfo; then
    HOROVOD_BUILD_ARCH_FLAGS="-mf16c -mavx -mfma"
  fi
fi
# "-mf16c -mavx -mfma" -> "f16c.avx.fma"
ARCH_KEY=$(printf '%s' "$HOROVOD_BUILD_ARCH_FLAGS" | sed 's/-m//g; s/^ *//; s/ *$//; s/ \+/./g' \
  | tr -c 'a-zA-Z0-9.=_\n' '_')
KEY="$PY_TAG-torch$TORCH_VERSION-tf$TF_VERSION-$MPI_VERSION-$ARCH${ARCH_KEY:+-$ARCH_KEY}"
# The directory is the key; the wheel keeps its standard name so pip accepts it.
WHEEL_DIR="$CACHE_DIR/horovod-$HOROVOD_VERSION/$KEY"
LOG="$CACHE_DIR/horovod-$HOROVOD_VERSION-$KEY.build.log"

# True when PYTHON imports horovod $HOROVOD_VERSION, its torch extension loads
# (an ABI mismatch with the installed torch fails here), both controllers are
# compiled in, and Horovod's build record (metadata.json) names the installed
# torch and TensorFlow versions. TensorFlow itself is not imported (seconds
# more on every `make test`); its extension library must merely be there.
installed_ok() {
  "$PY" - "$HOROVOD_VERSION" "$TORCH_VERSION" "$TF_VERSION" <<'EOF' >/dev/null 2>&1
import glob, json, os, sys
version, torch_version, tf_version = sys.argv[1:]
import horovod
assert horovod.__version__ == version, horovod.__version__
import horovod.torch as hvd
assert hvd.gloo_built() and hvd.mpi_built()
pkg = os.path.dirname(horovod.__file__)
with open(os.path.join(pkg, "metadata.json")) as f:
    built = json.load(f)
assert built.get("pytorch") == torch_version and built.get("tensorflow") == tf_version, built
assert glob.glob(os.path.join(pkg, "tensorflow", "mpi_lib*.so"))
EOF
}

if installed_ok; then
  say "horovod $HOROVOD_VERSION for torch $TORCH_VERSION + tensorflow $TF_VERSION" \
      "is already installed; nothing to do"
  exit 0
fi
say "phase 1/5: python $PY_TAG, torch $TORCH_VERSION, tensorflow $TF_VERSION, $MPI_VERSION, $ARCH"
say "  cache: $WHEEL_DIR"

# One build at a time per cache (two `make test` started together would
# otherwise both compile for many minutes and race on the wheel).
exec 9>"$CACHE_DIR/.build-horovod.lock"
if ! flock -n 9; then
  say "another build-horovod holds $CACHE_DIR/.build-horovod.lock; waiting"
  flock 9
  if installed_ok; then say "installed by the other run; nothing to do"; exit 0; fi
fi

install_wheel() {
  # With dependencies: horovod needs cloudpickle, psutil, pyyaml, packaging, cffi.
  "$PY" -m pip install -q --force-reinstall --no-deps "$1" \
    && "$PY" -m pip install -q "$1" && installed_ok
}

# A cache entry is trusted only whole (scripts/wheel_cache.py: the wheel, the checksum
# written after it, both agreeing, a sound zip); anything else there is removed.
WHEEL_CACHE="$(cd "$(dirname "$0")" && pwd)/wheel_cache.py"
if cached=$("$PY" "$WHEEL_CACHE" find "$WHEEL_DIR"); then
  if say "phase 2/5: installing cached wheel $cached" && install_wheel "$cached"; then
    say "done: horovod $HOROVOD_VERSION installed from cache in $((SECONDS - START)) s"
    exit 0
  fi
  say "the cached wheel installs but does not work here; removing it and building again"
  rm -rf "$WHEEL_DIR"
fi

# ---- build -----------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cgx-horovod-build.XXXXXX")
BUILD_PID=""
cleanup() {
  if [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; then
    kill -- "-$BUILD_PID" 2>/dev/null || kill "$BUILD_PID" 2>/dev/null || true
    wait "$BUILD_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'say "interrupted: stopping the build and removing $WORK"; exit 130' INT TERM

SDIST="$CACHE_DIR/horovod-$HOROVOD_VERSION.tar.gz"
if [ -f "$SDIST" ] && echo "$SDIST_SHA256  $SDIST" | sha256sum -c --status; then
  say "phase 2/5: using cached sdist $SDIST"
else
  say "phase 2/5: downloading the horovod $HOROVOD_VERSION sdist from PyPI"
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK/sdist" "horovod==$HOROVOD_VERSION" \
    || die "pip download horovod==$HOROVOD_VERSION failed"
  echo "$SDIST_SHA256  $WORK/sdist/horovod-$HOROVOD_VERSION.tar.gz" | sha256sum -c --status \
    || die "downloaded sdist does not have the expected sha256 $SDIST_SHA256"
  mv "$WORK/sdist/horovod-$HOROVOD_VERSION.tar.gz" "$SDIST.tmp.$$" && mv "$SDIST.tmp.$$" "$SDIST"
fi

say "phase 3/5: unpacking and patching"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/horovod-$HOROVOD_VERSION"
# Each patch replaces text that must occur exactly once upstream; anything
# else means the sources are not what the patch was written for.
"$PY" - "$SRC" <<'EOF' || die "patching the horovod sources failed (see above)"
import pathlib, sys

src = pathlib.Path(sys.argv[1])
PATCHES = [
    # torch >= 2.1 headers need C++17; Horovod forces C++14 at the top level ...
    ("CMakeLists.txt",
     "\nset(CMAKE_CXX_STANDARD 14)\n",
     "\nset(CMAKE_CXX_STANDARD 17)\n"),
    # ... and again for the PyTorch extension (torch >= 1.5).
    ("horovod/torch/CMakeLists.txt",
     "    set(CMAKE_CXX_STANDARD 14)\n",
     "    set(CMAKE_CXX_STANDARD 17)\n"),
    # The XLA custom-call ops only exist for GPU builds (their body is already
    # inside `#if HAVE_GPU`), but the XLA headers above that guard are included
    # for any TF >= 2.6 and no longer compile from a CPU TensorFlow's headers.
    ("horovod/tensorflow/xla_mpi_ops.cc",
     "\n#if TENSORFLOW_VERSION >= 2006000000\n",
     "\n#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU\n"),
]
failed = False
for rel, old, new in PATCHES:
    path = src / rel
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        print(f"  patch {rel}: expected the text {old.strip()!r} exactly once, found it "
              f"{count} times; upstream changed, update scripts/build-horovod.sh", file=sys.stderr)
        failed = True
        continue
    path.write_text(text.replace(old, new))
    print(f"  patched {rel}: {old.strip()!r} -> {new.strip()!r}")
sys.exit(1 if failed else 0)
EOF

mem_kb=$(awk '/MemTotal/ {print $2}' /proc/meminfo)
max_jobs=$(( mem_kb / (3 * 1024 * 1024) )); [ "$max_jobs" -ge 1 ] || max_jobs=1
JOBS=${HOROVOD_BUILD_JOBS:-$(nproc)}
[ "$JOBS" -le "$max_jobs" ] || JOBS=$max_jobs

say "phase 4/5: compiling ($JOBS jobs, arch flags '${HOROVOD_BUILD_ARCH_FLAGS}'); log: $LOG"
: > "$LOG"
(
  cd "$SRC"
  # Gloo and MPI both compiled in; no default CPU-operations library is baked
  # in, so each launcher picks its own at run time (horovodrun --gloo sets
  # HOROVOD_CONTROLLER/HOROVOD_CPU_OPERATIONS=gloo; under mpirun both default to MPI).
  unset HOROVOD_CPU_OPERATIONS HOROVOD_CONTROLLER HOROVOD_GPU_OPERATIONS HOROVOD_GPU \
        HOROVOD_WITHOUT_PYTORCH HOROVOD_WITHOUT_TENSORFLOW HOROVOD_WITHOUT_GLOO HOROVOD_WITHOUT_MPI
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
         HOROVOD_WITHOUT_MXNET=1 HOROVOD_BUILD_ARCH_FLAGS MAKEFLAGS="-j$JOBS"
  # setsid: the build gets its own process group, so an interrupt stops the
  # whole cmake/make/g++ tree (see cleanup).
  exec setsid "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$WORK/dist" .
) >>"$LOG" 2>&1 &
BUILD_PID=$!

last="" last_time=$SECONDS
while kill -0 "$BUILD_PID" 2>/dev/null; do
  sleep 5
  # make prints "[ 42%] Building CXX object ..." lines; report every ~30 s.
  pct=$(grep -o '^ *\[ *[0-9]*%\]' "$LOG" 2>/dev/null | tail -1 | tr -d '[] ' || true)
  if [ -n "$pct" ] && [ "$pct" != "$last" ] && [ $((SECONDS - last_time)) -ge 30 ]; then
    say "  compiling: $pct"
    last=$pct last_time=$SECONDS
  fi
done
if ! wait "$BUILD_PID"; then
  BUILD_PID=""
  # The first errors (compiler, CMake) come well before pip's closing noise.
  echo "----- first errors in $LOG -----" >&2
  { grep -n -E -A3 ': (fatal )?error:|CMake Error|\*\*\* \[' "$LOG" | head -n 40 >&2; } || true
  echo "----- last 30 lines of $LOG -----" >&2
  tail -n 30 "$LOG" >&2
  echo "----- end of log excerpts -----" >&2
  die "building horovod $HOROVOD_VERSION failed after $((SECONDS - START)) s; full log: $LOG"
fi
BUILD_PID=""

shopt -s nullglob
built=("$WORK"/dist/horovod-"$HOROVOD_VERSION"-*.whl)
shopt -u nullglob
[ ${#built[@]} -eq 1 ] || die "the build produced no horovod wheel; full log: $LOG"

say "phase 5/5: caching and installing $(basename "${built[0]}")"
stored=$("$PY" "$WHEEL_CACHE" store "${built[0]}" "$WHEEL_DIR") \
  || die "could not store the wheel in $WHEEL_DIR"
install_wheel "$stored" \
  || die "installed $stored but the check still fails; see: $PY -c 'import horovod.torch'"
say "done: horovod $HOROVOD_VERSION built and installed in $((SECONDS - START)) s (wheel cached in $WHEEL_DIR)"
