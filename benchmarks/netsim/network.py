"""Slow links between ranks, simulated with network namespaces, veth and tbf.

Each rank lives in its own network namespace with one veth interface. Two
ranks are joined by a single veth pair; more ranks each get a veth into a
"switch" namespace holding a Linux bridge. Every veth end that sends toward
the wire is shaped with ``tc ... root tbf``, so each rank has the configured
rate up and down, like a NIC. ``lo`` is never shaped: one loopback queue
carries both directions and would halve the rate.

Nothing is ever created in, or addressed from, the root namespace: the veths
are created from inside the rank namespaces (``ip -n NS link add``) and the
addresses live only there. Deleting a namespace deletes its veths.

Teardown runs on ``__exit__``, on SIGINT/SIGTERM (previous handlers are
restored and then called) and at interpreter exit. A run killed with SIGKILL
leaves namespaces named ``cgxns-<pid>-...``; ``python -m benchmarks.netsim
cleanup`` removes those whose process is gone.

:class:`SlowNetwork` composes the parts, each in its own module: where the
hosts live (:mod:`.endpoints`), their namespaces (:mod:`.namespaces`), the
veths and addresses (:mod:`.links`), the tbf qdiscs (:mod:`.tc`, parameters in
:mod:`.shaping`), the teardown hooks (:mod:`.teardown`) and the rank
processes (:mod:`.launch`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from . import links, tc
from .endpoints import (RankEndpoint, check_launch_settings, count_hosts, host_endpoints,
                        private_subnet)
from .errors import NetnsError, RankFailedError
from .launch import run_group
from .namespaces import (NAMESPACE_PREFIX, check_available, check_exec, create_namespaces,
                         delete_namespace, ip_command, list_namespaces, write_hosts_files)
from .results import LaunchResult
from .shaping import Shaping
from .teardown import TeardownHooks, signals_held

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_MASTER_PORT = 29500
_instance_ids = itertools.count()

Argv = Sequence[str]


class SlowNetwork:
    """N ranks in their own network namespaces, joined by tbf-shaped veth links.

    Args:
        n_ranks: number of ranks (>= 2).
        rate: tbf rate of every link direction ("100mbit", "1gbit", "10gbit"),
            or None for an unshaped link.
        burst: tbf bucket size ("256kb"); None: 256kb, or 2 ms of the rate if
            more (a small bucket caps 10gbit below its rate on a busy machine).
        latency: tbf queue bound ("50ms"); not an added delay.
        subnet: private IPv4 network for the rank addresses (rank r gets the
            (r+1)-th host address). Addresses exist inside the namespaces only.
        switch: join the ranks through a bridge in a switch namespace. Default:
            only for more than 2 ranks (2 ranks get a direct veth pair).
        master_port: MASTER_PORT of the first launch; later launches add 1 so a
            new rendezvous never meets a port still in TIME_WAIT.
        threads_per_rank: OMP_NUM_THREADS given to each rank (unless already
            set): ranks share this machine's few cores.
        ranks_per_host: ranks sharing one namespace (one simulated host). Ranks
            of a host talk over its unshaped loopback, hosts over the shaped
            links: ``n_ranks=4, ranks_per_host=2`` is 2 hosts x 2 ranks.

    Raises:
        ValueError/TypeError: for bad arguments (checked before anything is created).
        NetnsUnavailable: on :meth:`start` when this machine cannot do it
            (callers skip with ``err.reason``).

    Example:
        >>> with SlowNetwork(n_ranks=2, rate="1gbit") as net:            # doctest: +SKIP
        ...     times = net.run_function("benchmarks.netsim.probes:allreduce_probe",
        ...                              {"size_mb": 100})
    """

    def __init__(
        self,
        n_ranks: int = 2,
        rate: Optional[str] = "1gbit",
        burst: Optional[str] = None,
        latency: str = "50ms",
        *,
        subnet: str = DEFAULT_SUBNET,
        switch: Optional[bool] = None,
        master_port: int = DEFAULT_MASTER_PORT,
        threads_per_rank: int = 1,
        ranks_per_host: int = 1,
    ):
        n_hosts = count_hosts(n_ranks, ranks_per_host)
        self.shaping = Shaping(rate=rate, burst=burst, latency=latency)
        network = private_subnet(subnet, n_hosts)
        check_launch_settings(master_port, threads_per_rank)

        self.n_ranks = n_ranks
        self.ranks_per_host = ranks_per_host
        self.n_hosts = n_hosts
        self.subnet = network
        self.switch = n_hosts > 2 if switch is None else bool(switch)
        self.master_port = master_port
        self.threads_per_rank = threads_per_rank
        self.prefix = f"{NAMESPACE_PREFIX}{os.getpid()}-{next(_instance_ids)}-"
        self.switch_namespace: Optional[str] = f"{self.prefix}sw" if self.switch else None
        self.hosts: list[RankEndpoint] = host_endpoints(
            self.prefix, network, n_hosts, ranks_per_host, self.switch_namespace)
        self.ranks: list[RankEndpoint] = [
            dataclasses.replace(self.hosts[r // ranks_per_host], rank=r) for r in range(n_ranks)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._launches = 0
        self._hooks = TeardownHooks(self._close_quietly)
        self._state = "new"  # new -> started -> closed
        self._owner_pid = os.getpid()  # a forked child inherits our hooks but must not tear down

    # ------------------------------------------------------------------ info
    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this network (hosts first, then the switch)."""
        names = [ep.namespace for ep in self.hosts]
        return names + ([self.switch_namespace] if self.switch_namespace else [])

    @property
    def master_addr(self) -> str:
        """Rank 0's address: MASTER_ADDR of every rank."""
        return self.ranks[0].address

    @property
    def rate_bps(self) -> Optional[int]:
        """The shaped rate in bits/s, None when unshaped."""
        return self.shaping.bits_per_second

    def __repr__(self) -> str:
        hosts = f", {self.n_hosts} hosts" if self.ranks_per_host > 1 else ""
        return (f"SlowNetwork(n_ranks={self.n_ranks}{hosts}, {self.shaping.describe()}, "
                f"{'switch' if self.switch else 'veth pair'}, prefix={self.prefix!r}, state={self._state})")

    # -------------------------------------------------------------- lifecycle
    def __enter__(self) -> "SlowNetwork":
        # `net = SlowNetwork(...).start(); with net: ...` is fine too.
        return self if self._state == "started" else self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # Never hide the with-block's own exception behind a teardown error.
        self.close(raise_errors=exc_type is None)

    def start(self) -> "SlowNetwork":
        """Create namespaces, veths, addresses and qdiscs. Undone on any failure."""
        if self._state != "new":
            raise RuntimeError(f"this SlowNetwork is {self._state}; create a new one")
        check_available(need_tc=self.shaping.rate is not None)
        self._state = "started"
        self._hooks.install()
        try:
            self._build()
        except BaseException:
            self.close(raise_errors=False)
            raise
        return self

    def _build(self) -> None:
        # Our pid is in the names: any namespace with our prefix that we did not
        # create was left by a killed process that had the same pid.
        for stale in list_namespaces(self.prefix):
            delete_namespace(stale)
        create_namespaces(self.namespaces, self._created)
        write_hosts_files(self.hosts)
        check_exec(self.namespaces[0])
        if self.switch:
            links.join_through_switch(self.hosts, self.switch_namespace)
        else:
            links.join_directly(*self.hosts)
        links.address_hosts(self.hosts, self.subnet.prefixlen)
        tc.shape_links(self.shaping, self.hosts, self.switch_namespace)

    def close(self, raise_errors: bool = True) -> None:
        """Stop running ranks and delete every namespace of this network (idempotent).

        Args:
            raise_errors: raise :class:`NetnsError` if a namespace survives;
                otherwise only warn (used from signal handlers and atexit).
        """
        if self._state in ("new", "closed") or os.getpid() != self._owner_pid:
            self._state = "closed"
            return
        self._state = "closed"
        # A second Ctrl-C must not interrupt a half-done teardown: hold the
        # signals until it is complete; they are delivered right after.
        with signals_held():
            try:
                self._kill_ranks()
                # By prefix too: a signal may land between `ip netns add` and our bookkeeping.
                names = sorted(set(self._created) | set(list_namespaces(self.prefix)))
                left = [name for name in names if not delete_namespace(name)]
            finally:
                self._hooks.uninstall()
        if left:
            msg = (f"could not delete network namespaces {left}; "
                   f"remove them with: python -m benchmarks.netsim cleanup --all")
            if raise_errors:
                raise NetnsError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    def _kill_ranks(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _close_quietly(self) -> None:
        self.close(raise_errors=False)

    # ---------------------------------------------------------------- launch
    def netns_exec(self, rank: int) -> list[str]:
        """The argv prefix that runs a command inside ``rank``'s namespace (for own launchers)."""
        return [ip_command(), "netns", "exec", self.ranks[rank].namespace]

    def rank_env(self, rank: int, master_port: Optional[int] = None,
                 extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
        """The environment of ``rank``: this process's, plus what torch.distributed/Gloo need.

        Each namespace stands for one machine: LOCAL_RANK / LOCAL_WORLD_SIZE are
        the rank's place on its host (0 / 1 with one rank per host), GROUP_RANK /
        GROUP_WORLD_SIZE its host's index and the host count, so launcher-aware
        code treats exactly the shaped links as inter-node links.
        ``extra`` (the caller's variables) wins over everything.
        """
        ep = self.ranks[rank]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", str(self.threads_per_rank))
        env.setdefault("PYTHONUNBUFFERED", "1")  # output survives a kill
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.n_ranks),
            LOCAL_RANK=str(rank % self.ranks_per_host),
            LOCAL_WORLD_SIZE=str(self.ranks_per_host),
            GROUP_RANK=str(rank // self.ranks_per_host),  # torchrun's node index / node count
            GROUP_WORLD_SIZE=str(self.n_hosts),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port if master_port is None else master_port),
            GLOO_SOCKET_IFNAME=ep.ifname,
            TP_SOCKET_IFNAME=ep.ifname,
        )
        if extra:
            env.update({str(k): str(v) for k, v in extra.items()})
        return env

    def launch(
        self,
        cmd: Union[Argv, Sequence[Argv]],
        *,
        env: Optional[Mapping[str, str]] = None,
        rank_env: Optional[Sequence[Mapping[str, str]]] = None,
        timeout: float = 120.0,
        cwd: Optional[str] = None,
        master_port: Optional[int] = None,
        check: bool = False,
    ) -> LaunchResult:
        """Run one process per rank inside its namespace and wait for all of them.

        If a rank exits non-zero, the others are stopped at once (a Gloo peer
        would wait for it until its own timeout); at ``timeout`` all are stopped.

        Args:
            cmd: one argv for every rank (``[sys.executable, "train.py"]``), or
                a list of ``n_ranks`` argvs, one per rank.
            env: extra variables for every rank.
            rank_env: extra variables per rank (a list of ``n_ranks`` mappings).
            timeout: seconds for the whole group.
            cwd: working directory of the ranks.
            master_port: MASTER_PORT; default: a fresh port per launch.
            check: raise :class:`RankFailedError` unless every rank exited 0.

        Returns:
            :class:`LaunchResult` with each rank's exit code, stdout and stderr.
        """
        argvs = self._per_rank_argv(cmd)
        if rank_env is not None and len(rank_env) != self.n_ranks:
            raise ValueError(
                f"rank_env must hold {self.n_ranks} mappings (one per rank), got {len(rank_env)}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if self._state != "started":
            raise RuntimeError("launch() needs a started network (use `with SlowNetwork(...) as net:`); "
                               f"it is {self._state}")
        port = self.master_port + self._launches if master_port is None else master_port
        self._launches += 1
        envs, wrapped = [], []
        for ep in self.ranks:
            extra = dict(env or {})
            extra.update(rank_env[ep.rank] if rank_env is not None else {})
            envs.append(self.rank_env(ep.rank, master_port=port, extra=extra))
            wrapped.append([*self.netns_exec(ep.rank), *argvs[ep.rank]])
        try:
            result = run_group(wrapped, envs, timeout=timeout, cwd=cwd, on_start=self._procs.extend)
        finally:
            self._procs.clear()
        return result.check() if check else result

    def _per_rank_argv(self, cmd: Union[Argv, Sequence[Argv]]) -> list[list[str]]:
        if isinstance(cmd, (str, bytes)):
            raise TypeError(
                f"cmd must be an argv list such as [sys.executable, 'script.py'], not a string: {cmd!r}")
        cmd = list(cmd)
        if not cmd:
            raise ValueError("cmd is empty; give an argv such as [sys.executable, 'script.py']")
        if all(isinstance(part, str) for part in cmd):
            return [list(cmd) for _ in range(self.n_ranks)]
        if all(not isinstance(part, (str, bytes)) for part in cmd):
            if len(cmd) != self.n_ranks:
                raise ValueError(
                    f"per-rank cmd must hold {self.n_ranks} argvs (one per rank), got {len(cmd)}")
            argvs = [list(argv) for argv in cmd]
            if not all(argv and all(isinstance(p, str) for p in argv) for argv in argvs):
                raise TypeError("each per-rank argv must be a non-empty list of strings")
            return argvs
        raise TypeError("cmd must be one argv (a list of strings) or a list of argvs, not a mix")

    def run_function(
        self,
        target: str,
        kwargs: Optional[Mapping[str, Any]] = None,
        *,
        backend: Optional[str] = "gloo",
        timeout: float = 300.0,
        env: Optional[Mapping[str, str]] = None,
        python: Optional[str] = None,
    ) -> list[Any]:
        """Call ``module:function(**kwargs)`` in every rank; return each rank's JSON result.

        Every rank runs ``python -m benchmarks.netsim.worker``, which joins a
        torch.distributed process group (``backend``; None: no group), calls
        the function, and writes its return value as JSON to the file named
        by ``CGX_NETSIM_RESULT``. The function must be importable from the
        repository root (the ranks get it on PYTHONPATH).

        Args:
            target: ``"package.module:function"``.
            kwargs: JSON-serializable keyword arguments, the same for every rank.
            backend: torch.distributed backend to initialize, or None.
            timeout: seconds for the whole group.
            env: extra variables for every rank.
            python: interpreter of the ranks (default: this one).

        Returns:
            The function's return values, in rank order.

        Raises:
            RankFailedError: a rank failed, timed out, or wrote no result.

        Example:
            >>> net.run_function("benchmarks.netsim.probes:allreduce_probe",  # doctest: +SKIP
            ...                  {"size_mb": 10})
        """
        from . import worker  # light: no torch import here

        if not isinstance(target, str) or ":" not in target:
            raise ValueError(f"target must be 'package.module:function', got {target!r}")
        argv = [python or sys.executable, "-m", "benchmarks.netsim.worker", target,
                "--kwargs", worker.dumps(dict(kwargs or {})), "--backend", backend or "none"]
        with tempfile.TemporaryDirectory(prefix="cgx-netsim-res-") as tmp:
            paths = [os.path.join(tmp, f"rank{r}.json") for r in range(self.n_ranks)]
            result = self.launch(argv, env=env, rank_env=[{worker.RESULT_ENV: p} for p in paths],
                                 timeout=timeout, check=True)
            values = []
            for rank, path in enumerate(paths):
                if not os.path.exists(path):
                    raise RankFailedError(f"rank {rank} exited 0 but wrote no result to {path}", result)
                values.append(worker.load(path))
        return values
