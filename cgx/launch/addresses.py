"""The address other hosts reach this one at: interfaces, routes, host names.

:func:`advertised_address` picks the address rank 0 publishes for its store;
:func:`is_local_host` tells ``cgxrun`` whether a host is this machine. Only the
standard library is used, so that ``cgxrun`` and ``import cgx`` stay cheap.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Iterable, Mapping, Optional

from cgx.errors import CGXError, ConfigError


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw.strip()


_SIOCGIFADDR = 0x8915  # Linux ioctl: IPv4 address of an interface


def interface_address(ifname: str) -> str:
    """IPv4 address of network interface ``ifname`` (Linux).

    Raises:
        ConfigError: no such interface, or it has no IPv4 address.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", ifname.encode()[:15]))
    except OSError as e:
        names = ", ".join(name for _, name in socket.if_nameindex())
        raise ConfigError(f"network interface {ifname!r} has no IPv4 address ({e.strerror}); "
                          f"interfaces here: {names}. Fix GLOO_SOCKET_IFNAME / "
                          f"--network-interface") from None
    return socket.inet_ntoa(packed[20:24])


def local_addresses() -> set[str]:
    """IPv4 addresses of this host's interfaces (plus what its host name resolves to)."""
    found = {"127.0.0.1"}
    for _, name in socket.if_nameindex():
        try:
            found.add(interface_address(name))
        except ConfigError:
            pass
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return found


def is_local_host(host: str) -> bool:
    """True if ``host`` (name or address) is this machine."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:  # 127.x.y.z: this machine
            return True
    except ValueError:
        pass  # a name
    me = socket.gethostname()
    if host in (me, me.split(".")[0], socket.getfqdn()):
        return True
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    return bool(addrs & local_addresses())


def route_source_address(target: str) -> Optional[str]:
    """The local IPv4 address this host sends from to reach ``target``, or None.

    Uses a UDP ``connect``, which only consults the routing table: no packet
    is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


# Probed for "the interface that leads outside" when nothing better is known;
# route_source_address() sends nothing to it.
_OUTSIDE_PROBE = "8.8.8.8"


def advertised_address(env: Mapping[str, str], *, all_local: bool,
                       peers: Iterable[str] = ()) -> str:
    """The address other ranks should use to reach this host (rank 0's store).

    In order: the IPv4 address of the interface named by ``GLOO_SOCKET_IFNAME``
    (or ``HOROVOD_GLOO_IFACE``, ``NCCL_SOCKET_IFNAME``); ``127.0.0.1`` when every
    rank runs on this host; the source address of the route to a peer host
    (``peers``: other ranks' host names or horovodrun's rendezvous address);
    the source address of the route to the outside; what this host's name
    resolves to.

    Raises:
        CGXError: only loopback addresses were found while ranks run on
            several hosts; the message says which variable to set.
    """
    for var in ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME"):
        value = _get(env, var)
        if value is None:
            continue
        # NCCL's syntax allows "^lo" (exclude) and "=eth0" (exact); only a plain
        # or exact name names one interface.
        first = value.split(",")[0].strip().lstrip("=")
        if first and not first.startswith("^"):
            return interface_address(first)
    if all_local:
        return "127.0.0.1"
    candidates = []
    for peer in peers:
        try:
            addr = socket.getaddrinfo(peer, None, socket.AF_INET)[0][4][0]
        except OSError:
            continue
        candidates.append(route_source_address(addr))
    candidates.append(route_source_address(_OUTSIDE_PROBE))
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for addr in candidates:
        if addr and not _is_loopback(addr):
            return addr
    raise CGXError(f"could not find an address of host {socket.gethostname()!r} that other hosts "
                   f"can reach (only loopback found); set GLOO_SOCKET_IFNAME to the interface "
                   f"to use (cgxrun --network-interface), or MASTER_ADDR and MASTER_PORT")
