#!/usr/bin/env bash
# Install the system packages cgx's tests and benchmarks need, only when missing:
# Open MPI (mpirun + headers for mpi4py/Horovod), iproute2 (ip/tc for the
# slow-link simulator), a C/C++ compiler and cmake (C extension, Horovod build),
# and Chromium (tests/test_docs_browser.py opens the built site in it through
# Playwright; Debian's package, so nothing is downloaded by `playwright install`).
#   --demo: only what `make demo` needs (a C compiler for the extension).
set -euo pipefail

need=()
if [ "${1:-}" = --demo ]; then
  command -v gcc >/dev/null 2>&1 || need+=(gcc)
else
  command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
  [ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
    || command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
  command -v tc >/dev/null 2>&1 || need+=(iproute2)
  command -v gcc >/dev/null 2>&1 || need+=(gcc)
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  command -v make >/dev/null 2>&1 || need+=(make)
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
    || need+=(chromium)
fi

[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then sudo=""
elif command -v sudo >/dev/null 2>&1; then sudo="sudo"
else
  echo "cgx: missing system packages: ${need[*]}; install them (e.g. apt-get install ${need[*]}) or run as root." >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "cgx: missing system packages: ${need[*]}; this script knows apt-get only: install them with your package manager." >&2
  exit 1
fi
echo "cgx: installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
