"""Deprecated import path of world discovery: use :mod:`cgx.launch.world` (kept one release)."""

from cgx.launch.world import *  # noqa: F401,F403
from cgx.launch.world import (Launcher, WorldInfo, advertised_address, discover,  # noqa: F401
                              is_local_host)
