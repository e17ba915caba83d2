"""The network namespaces of the simulated hosts: ``ip netns`` and its files.

Every name this harness creates starts with :data:`NAMESPACE_PREFIX` followed by
the creating process's pid (``cgxns-<pid>-<instance>-<role>``), so that
:func:`cleanup_leftovers` can tell the namespaces of a killed run from those of
a live one. Each simulated host gets its own ``/etc/hosts`` under
:data:`ETC_NETNS`, which ``ip netns exec`` mounts over ``/etc``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from .errors import NetnsError, NetnsUnavailable

NAMESPACE_PREFIX = "cgxns-"
# `ip netns exec NS` bind-mounts the files of /etc/netns/NS over /etc: each
# simulated host gets its own /etc/hosts there.
ETC_NETNS = Path("/etc/netns")


def ip_command() -> str:
    """The path of iproute2's ``ip``; :class:`NetnsUnavailable` when it is missing."""
    path = shutil.which("ip")
    if path is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not on PATH; install iproute2")
    return path


def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command; :class:`NetnsError` with its stderr if it fails."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_available(need_tc: bool = True) -> None:
    """Raise :class:`NetnsUnavailable` with the reason if namespaces cannot work here.

    This checks only what can be checked without creating anything; creating
    the first namespace (in :meth:`SlowNetwork.start`) is the final test.
    """
    if not sys.platform.startswith("linux"):
        raise NetnsUnavailable(f"network namespaces need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"creating network namespaces needs root (effective uid is {os.geteuid()})")
    ip_command()
    if need_tc and shutil.which("tc") is None:
        raise NetnsUnavailable("the `tc` command (iproute2) is not on PATH; "
                               "install iproute2, or use rate=None")


def list_namespaces(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Names of the existing network namespaces that start with ``prefix``."""
    if shutil.which("ip") is None:
        return []
    out = run([ip_command(), "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def delete_namespace(name: str) -> bool:
    """Kill what still runs inside namespace ``name``, then delete it. True if it is gone.

    The processes killed here are inside a namespace this harness created, so
    they are rank processes it started (``ip netns pids`` lists only those).
    A namespace whose processes survived would outlive ``ip netns del``.
    """
    ip = ip_command()
    pids = run([ip, "netns", "pids", name], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    run([ip, "netns", "del", name], check=False)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    return name not in list_namespaces(name)


def _owner_pid(name: str) -> Optional[int]:
    # cgxns-<pid>-<instance>-<role>
    parts = name[len(NAMESPACE_PREFIX):].split("-")
    return int(parts[0]) if parts and parts[0].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(all_owners: bool = False, dry_run: bool = False) -> list[str]:
    """Delete namespaces left by killed runs; returns their names.

    Args:
        all_owners: also delete namespaces whose creating process still runs
            (only when you know no other run is using them).
        dry_run: only list what would be deleted.
    """
    victims = []
    for name in list_namespaces():
        pid = _owner_pid(name)
        if all_owners or pid is None or not _alive(pid):
            victims.append(name)
    if not dry_run:
        for name in victims:
            delete_namespace(name)
    return victims


def create_namespaces(names: Sequence[str], created: list[str]) -> None:
    """Create the namespaces ``names``, appending each to ``created`` as soon as it exists.

    The first ``ip netns add`` is the final test of this machine: its failure
    raises :class:`NetnsUnavailable`, a later one :class:`NetnsError`.
    """
    ip = ip_command()
    add = run([ip, "netns", "add", names[0]], check=False)
    if add.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {add.stderr.strip()}")
    created.append(names[0])
    for name in names[1:]:
        run([ip, "netns", "add", name])
        created.append(name)


def write_hosts_files(hosts: Iterable) -> None:
    """Give each host's namespace an ``/etc/hosts`` where this machine's name is its address.

    Like on a real machine, the host name resolves to the host's own address
    inside it (on this machine it resolves to 127.0.0.1, which peers cannot
    reach: Horovod's Gloo, for one, advertises that address).
    """
    hostname = socket.gethostname()
    for ep in hosts:
        (ETC_NETNS / ep.namespace).mkdir(parents=True, exist_ok=True)
        (ETC_NETNS / ep.namespace / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n{ep.address}\t{hostname}\n")


def check_exec(namespace: str) -> None:
    """:class:`NetnsUnavailable` unless ``ip netns exec`` can run a command in ``namespace``."""
    probe = run([ip_command(), "netns", "exec", namespace, "true"], check=False)
    if probe.returncode != 0:
        raise NetnsUnavailable(f"`ip netns exec` failed: {probe.stderr.strip()}")
