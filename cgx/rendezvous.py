"""Deprecated import path of the rendezvous: use :mod:`cgx.launch.rendezvous` (kept one release)."""

from cgx.launch.rendezvous import *  # noqa: F401,F403
from cgx.launch.rendezvous import exit_failing, install_mpi_abort_hook, make_store  # noqa: F401
