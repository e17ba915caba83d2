"""cgx's compressed exchange inside torchft's fault-tolerant DDP, with the real torchft
(the pinned 0.2.0): its lighthouse, one Manager per replica group, examples/torchft_ddp.py
as the replica groups.

Two replica groups train the digits MLP, with 4-bit and error feedback or with PowerSGD
(whose factors every group must hold alike), in DDP buckets of about 8 kB (several per
step). The test kills
one with SIGKILL, checks that the other goes on alone without going back a step, starts
the killed one again, and checks that it heals from its live peer (the model, the
optimizer and cgx's shared state; no checkpoint) and that both then hold the same
parameters after every step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torchft  # noqa: E402,F401 - the bench extra, which make test installs

pytestmark = pytest.mark.multiproc

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchft_ddp.py"
STEPS = 160
DEADLINE_S = 200
PARAMS = 64 * 128 + 128 + 128 * 10 + 10  # the example's MLP
STANDBY = """
import os, runpy, sys, time
import sklearn.datasets, torch, torchft.manager, cgx.torch, cgx.integrations.torchft
go, example = sys.argv[1:3]
while not os.path.exists(go):
    time.sleep(0.02)
sys.argv = [example, *sys.argv[3:]]
runpy.run_path(example, run_name="__main__")
"""


class Replicas:
    def __init__(self, tmp: Path, lighthouse: str, compression: str):
        self.tmp, self.lighthouse, self.compression = tmp, lighthouse, compression
        self.log = tmp / "log"
        self.log.mkdir()
        self.procs: dict = {}
        self.start = time.monotonic()

    def launch(self, replica: int, go: Path | None = None) -> subprocess.Popen:
        """The example as replica group ``replica``; with ``go``, a stand-by that has
        imported torch, torchft and cgx and starts the example once ``go`` exists (so that
        a restart under load is not slower than the survivor's remaining steps)."""
        args = ["--replica-id", str(replica), "--lighthouse", self.lighthouse, "--steps",
                str(STEPS), "--step-sleep", "0.03", "--compression", self.compression,
                "--bucket-cap-mb", "0.008", "--log", str(self.log)]
        cmd = [sys.executable, str(EXAMPLE), *args] if go is None else \
            [sys.executable, "-c", STANDBY, str(go), str(EXAMPLE), *args]
        out = open(self.tmp / f"replica{replica}-{len(self.procs)}.txt", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[(replica, len(self.procs))] = proc
        return proc

    def rows(self) -> dict:
        """(replica, pid) -> its logged steps."""
        out = {}
        for f in self.log.glob("*.jsonl"):
            replica, pid = (int(v) for v in f.stem.split("-"))
            lines = [ln for ln in f.read_text().splitlines() if ln.endswith("}")]
            out[(replica, pid)] = [json.loads(ln) for ln in lines]
        return out

    def wait_for(self, what, check) -> dict:
        while time.monotonic() - self.start < DEADLINE_S:
            rows = self.rows()
            if check(rows):
                return rows
            time.sleep(0.05)
        pytest.fail(f"{what} did not happen; output:\n{self.output()}")

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}"
                         for p in sorted(self.tmp.glob("replica*.txt")))

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _last_step(rows, replica) -> int:
    return max((r["step"] for (rep, _), rs in rows.items() if rep == replica for r in rs),
               default=0)


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                              heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


@pytest.mark.parametrize("compression", ["4bit-ef", "powersgd"])
def test_a_killed_replica_group_heals_from_its_peer_and_the_exchange_stays_compressed(
        tmp_path, lighthouse, compression):
    run = Replicas(tmp_path, lighthouse, compression)
    try:
        run.launch(0)
        victim = run.launch(1)
        go = tmp_path / "go"
        run.launch(1, go=go)  # the restart, standing by
        run.wait_for("both groups training together", lambda r: any(
            x["participants"] == 2 and x["step"] >= 25 for (rep, _), rs in r.items()
            if rep == 1 for x in rs))
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        killed_at = _last_step(run.rows(), 1)
        run.wait_for("the survivor going on alone", lambda r: any(
            x["participants"] == 1 and x["step"] >= killed_at + 10
            for (rep, _), rs in r.items() if rep == 0 for x in rs))
        go.touch()  # the killed group starts again
        for (replica, _), proc in list(run.procs.items()):
            if proc.poll() is None or replica == 0:
                assert proc.wait(max(1, DEADLINE_S - (time.monotonic() - run.start))) == 0, \
                    run.output()
    finally:
        run.close()
    rows = run.rows()
    survivor = [rs for (rep, _), rs in rows.items() if rep == 0]
    assert len(survivor) == 1, "replica group 0 was restarted"
    steps = [r["step"] for r in survivor[0]]
    # never back: a failure cost at most the step in flight, which the manager discarded
    assert all(b >= a for a, b in zip(steps, steps[1:])) and steps[-1] == STEPS
    assert survivor[0][-1]["discarded"] <= 2
    healed = next(rs for (rep, pid), rs in rows.items() if rep == 1 and pid != victim.pid)
    # from its peer's state, not from step 0 (under load it may first train a few steps
    # in a quorum of its own, min_replicas being 1; the survivor's steps never go back)
    joined = next(r for r in healed if r["participants"] == 2)
    assert joined["step"] > killed_at + 10
    # the same parameters after every step both logged, before the kill and after the heal
    by_step: dict = {}
    for rs in rows.values():
        for r in rs:
            if r["participants"] == 2:
                by_step.setdefault(r["step"], set()).add(r["digest"])
    assert all(len(d) == 1 for d in by_step.values()), by_step
    shared = sorted(by_step)
    assert sum(s <= killed_at for s in shared) >= 5 and sum(s > killed_at for s in shared) >= 5
    # several times fewer bytes per step than an fp32 ring allreduce of 2 groups
    together = [(b["sent"] - a["sent"]) for a, b in zip(healed, healed[1:])
                if b["participants"] == 2 and b["step"] == a["step"] + 1]
    assert together and max(together) * 5 < 4 * PARAMS, together
    print(f"\n{compression}: {max(together)} B a step against {4 * PARAMS} B in fp32; "
          f"the survivor discarded {survivor[0][-1]['discarded']} step(s) and undid "
          f"{survivor[0][-1]['undone']}")
    losses = [r["loss"] for r in survivor[0]]
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20])


# -- the transport over torchft's group, and the state's own rules -------------------------

def _transports_agree(rank, world, port):
    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo
    from cgx.collectives import Reducer
    from cgx.comm.base import ReduceOp
    from cgx.comm.torch_dist import TorchTransport
    from cgx.compression import Compression
    from cgx.config import Config
    from cgx.exchange import GradientPlan
    from cgx.integrations.torchft import TorchftTransport
    store = dist.TCPStore("localhost", port, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupGloo()
    pg.configure(f"localhost:{port}/quorum0", "r", rank, world)
    ft = TorchftTransport(pg)
    out = {"rank": ft.rank, "size": ft.size}
    g = torch.randn(96, 80, generator=torch.Generator().manual_seed(rank))
    cfg = Config(minimal_size=0)
    for name, tr in (("torchft", ft), ("torch", TorchTransport())):
        plan = GradientPlan(["w"], [(96, 80)], Compression.quantize(bits=4), op=ReduceOp.SUM,
                            config=cfg)
        red = Reducer(tr, cfg)
        out[name] = red.engine().submit(
            lambda: plan.reduce([g.clone()], name="w", step=3, reducer=red)).wait(60)[0]
        red.close()
    x = torch.arange(6.0) + 10 * rank
    gathered = torch.empty(6 * world)
    ft.allgather(gathered, x)
    out["gathered"] = gathered
    del store
    return out


def test_the_transport_over_torchfts_group_reduces_as_torch_distributed_does():
    from spawn import free_port, run_gloo
    import torch
    results = run_gloo(_transports_agree, 3, free_port())
    for rank, r in enumerate(results):
        assert (r["rank"], r["size"]) == (rank, 3)  # the configured group's, not 0 of 1
        assert torch.equal(r["torchft"], r["torch"])
        assert r["gathered"].tolist() == [float(v + 10 * k) for k in range(3) for v in range(6)]


class _Manager:
    """What TorchftState asks of torchft's Manager around a step (no process group: the
    engine is never made, so each step here is one whose exchange could not start)."""

    def __init__(self):
        self.fns, self.errors, self.step = {}, [], 5
        self._healing, self._pending_state_dict = False, None

    def register_state_dict_fn(self, key, load, save):
        self.fns[key] = (load, save)

    def report_error(self, e):
        self.errors.append(e)

    def errored(self):
        return None

    def wait_quorum(self):
        pass

    def current_step(self):
        return self.step


def test_the_state_refuses_plans_undoes_discarded_steps_and_heals_without_residuals():
    import torch
    from cgx.compression import Compression
    from cgx.integrations.torchft import TorchftState
    model = torch.nn.Linear(40, 30)
    with pytest.raises(ValueError, match="fixed compression"):
        TorchftState(_Manager(), model, compression="auto")
    manager = _Manager()
    state = TorchftState(manager, model,
                         compression=Compression.quantize(bits=2, error_feedback=True))
    name = state.plan.names[0]
    held = state.plan.residuals.residuals

    assert state.begin_step().failed and len(manager.errors) == 1  # no group: lost
    held[name] = torch.ones(1200)  # what the step changed
    state.begin_step()  # the manager did not advance: that step was discarded
    assert name not in state.plan.residuals.residuals and state.undone == 1
    state.plan.residuals.residuals[name] = torch.ones(1200)
    manager.step = 6  # committed
    state.begin_step()
    assert float(state.plan.residuals.residuals[name].sum()) == 1200 and state.undone == 1

    load, save = manager.fns["cgx"]
    shared = save()
    assert not isinstance(shared["plan"]["residuals"], dict)  # each group's own: not sent
    shared["plan"]["step"] = 77
    manager._healing, manager._pending_state_dict = True, {"user": {"cgx": shared}}
    manager.step = 9
    state.begin_step()  # a heal's state, applied before the exchange
    assert state.plan.step == 77
    assert float(state.plan.residuals.residuals[name].sum()) == 1200  # its own kept
    state.plan.step = 78  # the step's exchange moved it on
    load(shared)  # torchft applies the heal after the step: already done, not again
    assert state.plan.step == 78
