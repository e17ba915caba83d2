"""``cgxrun``'s elastic driver: start ranks, replace lost ones, let new hosts join.

``cgxrun -np N --min-np M [--max-np K] [-H hosts | --host-discovery-script S]`` runs
this driver instead of torch.distributed.run. It

* hosts the job's membership store (a torch.distributed ``TCPStore`` on 127.0.0.1)
  on which the ranks run torch.distributed.elastic's dynamic rendezvous
  (:mod:`cgx.launch.membership`): ranks form each world there themselves, so
  survivors keep their processes when a rank is lost;
* starts N ranks on the hosts' slots, and later one more on every free slot while
  fewer than K run (a host that the discovery script adds, or a slot that a lost rank
  freed once its host's cooldown is over);
* blacklists the host of a rank that fails (for a time drawn from
  ``--blacklist-cooldown-range``, else for good, as horovodrun);
* runs the discovery script every second (lines ``HOST`` or ``HOST:SLOTS``); a script
  that fails or prints something else stops the job at the start, and later is
  reported and its last good answer kept;
* ends when no rank runs: with 0 once a rank has finished and every rank after it
  finished too, else with the last failure's code (128 + signal for a killed rank).
  When fewer than M ranks are left and no slot can take another, it waits
  ``--start-timeout`` seconds (default 600) for the discovery script to offer more,
  then stops the job with a message.

Ranks start on this machine only: every host must name it (``localhost``, its name,
an address of its own; any 127.x.y.z is one). Several machines are not supported in
elastic mode yet: the message says so.
"""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from typing import Callable, Mapping, Optional, Sequence

from cgx.launch.addresses import is_local_host
from cgx.launch.slots import assign, free_slot, worker_env
from cgx.launch.spec import ElasticSpec, Host, UsageError
from cgx.launch.world import WorldInfo

POLL_S = 0.2
DISCOVERY_PERIOD_S = 1.0
DISCOVERY_TIMEOUT_S = 30.0


def check(spec: ElasticSpec, num_proc: int) -> None:
    """Raise :class:`UsageError` for bounds that cannot work."""
    if spec.min_np < 1:
        raise UsageError(f"--min-np {spec.min_np} must be at least 1")
    if spec.min_np > num_proc:
        raise UsageError(f"--min-np {spec.min_np} is above -np {num_proc}: the job would "
                         f"start below its own minimum; lower --min-np or raise -np")
    if spec.max_np < num_proc:
        raise UsageError(f"--max-np {spec.max_np} is below -np {num_proc}; raise --max-np "
                         f"or lower -np")
    if spec.reset_limit is not None and spec.reset_limit < 0:
        raise UsageError(f"--reset-limit {spec.reset_limit} must be 0 or more")
    if spec.cooldown is not None:
        lo, hi = spec.cooldown
        if not 0 <= lo <= hi:
            raise UsageError(f"--blacklist-cooldown-range {lo:g} {hi:g}: expected "
                             f"0 <= MIN <= MAX seconds, e.g. 10 100")


def parse_discovery(text: str, script: str) -> tuple[Host, ...]:
    """The hosts a discovery script printed (``HOST`` or ``HOST:SLOTS`` per line).

    Raises:
        UsageError: a line that is neither, or a host that is not this machine.
    """
    hosts = []
    for line in text.splitlines():
        item = line.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        slots = slots or "1"
        if not name or " " in name or not slots.isdigit() or int(slots) < 1:
            raise UsageError(f"the host discovery script {script!r} printed {item!r}; each "
                             f"line must be HOST or HOST:SLOTS (e.g. localhost:2)")
        hosts.append(Host(name, int(slots)))
    _check_local(hosts, f"the host discovery script {script!r}")
    return tuple(hosts)


def _check_local(hosts: Sequence[Host], source: str) -> None:
    remote = [h.name for h in hosts if not is_local_host(h.name)]
    if remote:
        raise UsageError(f"{source} names {', '.join(remote)}, not this machine; cgxrun's "
                         f"elastic mode starts ranks on this machine only (hosts may be "
                         f"localhost, 127.x.y.z, or this machine's names and addresses)")


def run_discovery(script: str, timeout: float = DISCOVERY_TIMEOUT_S) -> tuple[Host, ...]:
    """Run the discovery script once (raises :class:`UsageError` when it fails)."""
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"the host discovery script {script!r} could not run: {e}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UsageError(f"the host discovery script {script!r} exited with "
                         f"{done.returncode}: {tail[0]}")
    return parse_discovery(done.stdout, script)


@dataclasses.dataclass
class _Rank:
    host: str
    proc: subprocess.Popen
    slot: int = 0  # its place among its host's slots (HOROVOD_LOCAL_RANK at its start)


class Driver:
    """One elastic job (see the module docstring).

    Args:
        num_proc: ranks to start with.
        command: the rank's program.
        env: the ranks' environment (cgxrun's variables and the job's secret included).
        spec: the bounds and the hosts' source.
        hosts: fixed hosts (``-H``) when there is no discovery script.
        say: where the driver's lines go.
    """

    def __init__(self, num_proc: int, command: Sequence[str], env: Mapping[str, str],
                 spec: ElasticSpec, hosts: Sequence[Host], say: Callable[[str], None]):
        self.num_proc, self.command, self.env, self.spec = num_proc, list(command), env, spec
        self.say = say
        self.hosts = tuple(hosts) or (Host("localhost", spec.max_np),)
        self.ranks: list[_Rank] = []
        self.blacklist: dict[str, float] = {}  # host -> when it may take ranks again
        self.finishing = False
        self.codes: list[int] = []  # exit codes, in order
        self.started = 0
        self._short_since: Optional[float] = None

    # -- hosts and slots ---------------------------------------------------------------
    def _refresh_hosts(self) -> None:
        if self.spec.discovery_script is None:
            return
        try:
            self.hosts = run_discovery(self.spec.discovery_script)
        except UsageError as e:
            self.say(f"{e}; keeping the last hosts it gave")

    def _free_slots(self) -> list[str]:
        now = time.monotonic()
        free = []
        for h in self.hosts:
            if self.blacklist.get(h.name, 0.0) > now:
                continue
            used = sum(1 for r in self.ranks if r.host == h.name)
            free += [h.name] * max(0, h.slots - used)
        return free

    # -- ranks -------------------------------------------------------------------------
    def _start(self, slot: int, place: WorldInfo) -> None:
        """A rank on ``place.hostname``'s ``slot``; ``place``: its horovodrun numbering."""
        env = dict(self.env)
        from cgx.launch.elastic_env import FIRST_VAR, HOST_VAR
        host = place.hostname
        env.update(worker_env(place))  # horovodrun's worker variables (cgx.launch.slots)
        env[HOST_VAR] = host
        if self.started < self.num_proc:  # one of the job's first ranks: see FIRST_VAR
            env[FIRST_VAR] = str(self.num_proc)
        proc = subprocess.Popen(self.command, env=env)
        self.ranks.append(_Rank(host, proc, slot))
        self.started += 1
        if self.started > self.num_proc:
            self.say(f"started a rank on {host} (pid {proc.pid}); it joins at the next commit")

    def _reap(self) -> None:
        for r in list(self.ranks):
            code = r.proc.poll()
            if code is None:
                continue
            self.ranks.remove(r)
            code = 128 - code if code < 0 else code
            self.codes.append(code)
            if code == 0:
                self.finishing = True
                continue
            self._blacklist(r, code)

    def _blacklist(self, r: _Rank, code: int) -> None:
        how = f"signal {code - 128}" if code > 128 else f"code {code}"
        if self.finishing:
            self.say(f"the rank on {r.host} (pid {r.proc.pid}) exited with {how} after "
                     f"others had finished")
            return
        if self.spec.cooldown is None:
            until, note = float("inf"), "for the rest of the job"
        else:
            wait = random.uniform(*self.spec.cooldown)
            until, note = time.monotonic() + wait, f"for {wait:.0f} s"
        self.blacklist[r.host] = until
        self.say(f"the rank on {r.host} (pid {r.proc.pid}) exited with {how}; the others go "
                 f"on without it; {r.host} takes no ranks {note}")

    def _fill(self, limit: int) -> None:
        if self.finishing:
            return
        new = []
        placed = [(r.host, r.slot) for r in self.ranks]
        for host in self._free_slots()[:max(0, limit - len(self.ranks))]:
            slot = free_slot(s for h, s in placed if h == host)
            placed.append((host, slot))
            new.append((host, slot))
        if not new:
            return
        places = assign(placed, [h.name for h in self.hosts])
        for host, slot in new:
            self._start(slot, places[host, slot])

    def _check_short(self) -> Optional[int]:
        """Fewer than min_np ranks and no slot for more: wait, then stop the job."""
        if self.finishing or len(self.ranks) >= self.spec.min_np or not self.ranks:
            self._short_since = None
            return None
        now = time.monotonic()
        self._short_since = self._short_since or now
        if now - self._short_since < self.spec.wait_s:
            return None
        self.say(f"only {len(self.ranks)} rank(s) left, below --min-np {self.spec.min_np}, "
                 f"and no host offered a slot for {self.spec.wait_s:g} s; stopping the job")
        self.stop()
        return 1

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.send_signal(sig)
        deadline = time.monotonic() + 10
        for r in self.ranks:
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()

    def result(self) -> int:
        if self.finishing:
            after = self.codes[self.codes.index(0):]
            return next((c for c in after if c != 0), 0)
        return self.codes[-1] if self.codes else 1

    def run(self) -> int:
        if len(self._free_slots()) < self.spec.min_np:
            have = len(self._free_slots())
            raise UsageError(f"the hosts offer {have} slot(s), fewer than --min-np "
                             f"{self.spec.min_np}")
        self._fill(self.num_proc)
        next_discovery = time.monotonic() + DISCOVERY_PERIOD_S
        while self.ranks:
            time.sleep(POLL_S)
            self._reap()
            if time.monotonic() >= next_discovery:
                self._refresh_hosts()
                next_discovery = time.monotonic() + DISCOVERY_PERIOD_S
            if self.ranks:
                self._fill(self.spec.max_np)
            code = self._check_short()
            if code is not None:
                return code
        return self.result()


def run_elastic(num_proc: int, command: Sequence[str], env: Mapping[str, str],
                spec: ElasticSpec, hosts: Sequence[Host], timeout_s: Optional[float],
                say: Callable[[str], None]) -> int:
    """Host the membership store, run the :class:`Driver`; returns the job's exit code."""
    import datetime

    import torch.distributed as dist

    from cgx.launch.elastic_env import ElasticEnv
    check(spec, num_proc)
    if spec.discovery_script is not None:
        hosts = run_discovery(spec.discovery_script)
    else:
        _check_local(hosts, "-H")
    wait = timeout_s if timeout_s is not None else 600.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=wait))
    member_env = ElasticEnv(addr="127.0.0.1", port=store.port,
                            run_id=f"cgx-{secrets.token_hex(4)}", min_np=spec.min_np,
                            max_np=spec.max_np, reset_limit=spec.reset_limit,
                            timeout_s=wait).as_env()
    driver = Driver(num_proc, command, {**env, **member_env},
                    dataclasses.replace(spec, wait_s=wait), hosts, say)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, frame):
        driver.stop(signum)
        raise SystemExit(128 + signum)

    for s in previous:
        if previous[s] is not signal.SIG_IGN:
            signal.signal(s, on_signal)
    try:
        return driver.run()
    finally:
        driver.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        del store
        if os.environ.get("CGX_VERBOSE") == "1":
            print(f"cgxrun: elastic job done: {driver.started} rank(s) started, exit codes "
                  f"{driver.codes}", file=sys.stderr, flush=True)
