"""What torch's TCPStore does with hostile clients, measured on loopback.

For each server backend (libuv, the default, and the legacy one:
``TCPStore(..., use_libuv=False)``) a store server runs in a child process,
bound to 127.0.0.1 only (through ``master_listen_fd``), and a well-behaved
client keeps talking to it while a raw TCP client

1. writes 64 KiB of random bytes and hangs up ("garbage"),
2. sends the first bytes of a SET request and then stays silent ("cut short"),
3. announces a key of 2**40 bytes ("huge length"),

and a stranger's ``TCPStore`` client that only knows the port lists, reads and
overwrites the keys. After each step the script checks that the server
process is alive, that the first client's next request succeeds (and how long
it took) and that a new client can connect. docs/security.md quotes the output.

Run from the repository root (under a minute, nothing is left behind)::

    python -m benchmarks.tcpstore_garbage
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time

# torch's store protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): one byte
# of query type, then each string as a native uint64 length and its bytes.
_VALIDATE, _SET = 0, 1
# A client's first message: VALIDATE and this magic number (TCPStoreBackend.hpp).
_HELLO = bytes([_VALIDATE]) + struct.pack("=I", 0x3C85F7CE)
_PROBE_TIMEOUT_S = 3.0  # the clients' own timeout
_STUCK_S = 5.0  # no answer after this long: the server is stuck for that client


def serve(use_libuv: bool) -> None:
    """Child: a store server on 127.0.0.1; prints its port, runs until stdin closes."""
    import torch.distributed as dist
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30), use_libuv=use_libuv,
                          master_listen_fd=sock.detach())  # the store owns the fd now
    print(port, flush=True)
    sys.stdin.read()
    del store


def _client(port: int):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, None, False,
                         timeout=datetime.timedelta(seconds=_PROBE_TIMEOUT_S))


def _bounded(fn, limit_s: float):
    """fn() on a daemon thread: ("ok", seconds), ("error", name) or ("stuck", limit_s).

    A client blocked inside torch does not always honour its own timeout, so the
    script never waits on one directly.
    """
    out = []

    def call():
        t0 = time.perf_counter()
        try:
            fn()
            out.append(("ok", time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - what fails is the finding
            out.append(("error", type(e).__name__))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(limit_s)
    return out[0] if out else ("stuck", limit_s)


def _probe(server: subprocess.Popen, state: dict, port: int) -> str:
    """One line: server alive?, the good client's round trip, a new client.

    A good client that got stuck is replaced by a new one for the next steps.
    """
    alive = server.poll() is None
    good = state["good"]
    how, t = _bounded(lambda: (good.set("probe", "1"), good.get("probe")), _STUCK_S)
    if how == "ok":
        old = f"old client ok in {1e3 * t:.1f} ms"
    elif how == "stuck":
        old = f"old client got NO ANSWER within {t:g} s"
    else:
        old = f"old client FAILED ({t})"
    how, t = _bounded(lambda: _client(port).get("probe"), _STUCK_S)
    new = {"ok": "new client ok", "stuck": f"new client got NO ANSWER within {_STUCK_S:g} s"
           }.get(how, f"new client FAILED ({t})")
    if "ok" not in old:
        state["good"] = None  # still blocked in its thread
        fresh = _bounded(lambda: state.__setitem__("good", _client(port)), _STUCK_S)
        if fresh[0] != "ok":
            state["good"] = None
    return f"server {'alive' if alive else 'DEAD (exit %s)' % server.returncode}; {old}; {new}"


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _dropped(s: socket.socket) -> str:
    """Whether the server hung up on the raw client (within 0.3 s)."""
    s.settimeout(0.3)
    try:
        return "server hung up" if s.recv(1) == b"" else "server answered"
    except socket.timeout:
        return "connection kept open"
    except OSError:
        return "server reset the connection"


def run_backend(use_libuv: bool) -> list[str]:
    name = "libuv" if use_libuv else "legacy"
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.tcpstore_garbage", "--serve",
                               name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        port = int(server.stdout.readline())
        state = {"good": _client(port)}
        state["good"].set("job/key", "the job's value")

        with _raw(port) as s:  # 1. garbage
            s.sendall(random.Random(0).randbytes(64 << 10))
            how = _dropped(s)
        lines.append(f"{name}: garbage (64 KiB random; {how}) -> {_probe(server, state, port)}")

        for hello, what in ((b"", "unvalidated"), (_HELLO, "after VALIDATE")):
            s = _raw(port)  # 2. a request cut short, the connection kept open
            s.sendall(hello + bytes([_SET]) + struct.pack("=Q", 1000) + b"abc")
            how = _dropped(s)
            lines.append(f"{name}: cut-short SET {what}, held open ({how}) -> "
                         f"{_probe(server, state, port)}")
            s.close()
            time.sleep(0.1)

            with _raw(port) as s:  # 3. a length the server would have to allocate
                s.sendall(hello + bytes([_SET]) + struct.pack("=Q", 1 << 40) + b"x" * 64)
                how = _dropped(s)
            time.sleep(0.1)
            lines.append(f"{name}: key length 2**40 {what} ({how}) -> "
                         f"{_probe(server, state, port)}")

        good = state["good"] or _client(port)
        if server.poll() is None:  # 4. a stranger with a client of its own
            stranger = _client(port)
            keys = sorted(stranger.list_keys()) if hasattr(stranger, "list_keys") else "n/a"
            seen = stranger.get("job/key").decode()
            stranger.set("job/key", "overwritten")
            after = good.get("job/key").decode()
            lines.append(f"{name}: stranger lists keys {keys}, reads {seen!r}, overwrites: the "
                         f"job now reads {after!r}")
    finally:
        if server.poll() is None:
            server.stdin.close()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return lines


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2] == "libuv")
        return 0
    import torch
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, loopback only")
    t0 = time.perf_counter()
    for use_libuv in (True, False):
        for line in run_backend(use_libuv):
            print(line, flush=True)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
