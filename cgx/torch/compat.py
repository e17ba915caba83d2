"""The rest of ``horovod.torch``'s public names: aliases, and clear refusals.

Every name Horovod 0.28.1 exports is either implemented by ``cgx.torch`` with
Horovod's semantics, or here raises :class:`NotImplementedError` saying what
to use instead (``tests/test_horovod_api.py`` checks the list against an
installed Horovod; docs/horovod.md has the table).
"""

from __future__ import annotations

from cgx import compression  # noqa: F401 - horovod.torch.compression
from cgx.errors import CGXError

# Horovod raises HorovodInternalError when a collective fails (elastic jobs catch it);
# cgx raises CGXError there.
HorovodInternalError = CGXError


def check_extension(ext_name=None, ext_env_var=None, pkg_path=None, *args) -> None:
    """Horovod checks its compiled extension here; cgx has none to check."""


def refuse(what: str, instead: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{what} is not supported by cgx; {instead}")
    fn.__name__ = what.split("(")[0].split(".")[-1]
    fn.__doc__ = f"Not supported by cgx: {instead}"
    return fn
