"""Where a CUDA tensor's compression runs (cgx.policy.planner.placement), decided on CPU from profiles.

The decision is pure arithmetic over a DeviceProfile, so it is tested here without a GPU:
it flips as the profile says it should (a busy GPU with fast PCIe and host sends tensors
to the host; slow PCIe, a slow host, an idle GPU or lane-bound large tensors keep them
on the GPU), the profile round-trips, bad values fail with a message naming the field.
The offload path itself runs in tests/test_offload.py (marked gpu).
"""

from __future__ import annotations

import json
import pickle

import pytest

from cgx.policy.planner import CostModel, TensorProfile, options_for, plan
from cgx.policy.planner.placement import (DeviceProfile, Placement, costs, decide, place,
                                   placement_of)

H200 = DeviceProfile.h200()


def _model(device, gbit=3.0):
    # the GPU's kernels as the cost model's quantizer, as a CUDA job would calibrate it
    return CostModel.uniform(2, gbit, device=device, compress_bps=700e9, decompress_bps=1300e9)


def _plan(device, numel=1 << 20, count=20, backward=0.1):
    """Tensors ready over the first 80% of backward; at 3 Gbit/s exact does not hide, 4-bit
    does, so the step is backward plus whatever the exchange takes from the compute."""
    ts = [TensorProfile(f"t{i}", numel, 0.8 * backward * (i + 1) / count) for i in range(count)]
    return plan(ts, _model(device), backward)


def _placements(p):
    return [placement_of(o.name) for o in p.chosen if o.name != "exact"]


def test_busy_gpu_with_fast_host_and_pcie_offloads_the_hidden_tensors():
    off = _plan(H200)
    assert off.timeline.step_s == pytest.approx(0.1)  # nothing taken from the compute
    assert _placements(off) and set(_placements(off)) == {Placement.CPU_OFFLOAD}
    on_gpu = _plan(DeviceProfile.h200(d2h_gbps=0.5, h2d_gbps=0.5))
    assert off.timeline.step_s < on_gpu.timeline.step_s


@pytest.mark.parametrize("overrides", [
    dict(d2h_gbps=0.5, h2d_gbps=0.5),  # slow PCIe
    dict(host_quantize_gbps={1: 0.3}, host_dequantize_gbps={1: 0.5}),  # slow host
    dict(gpu_busy=0.0),  # the GPU idles during backward: its kernels cost the step nothing
], ids=["slow-pcie", "slow-host", "idle-gpu"])
def test_the_gpu_keeps_its_tensors(overrides):
    p = _plan(DeviceProfile.h200(**overrides))
    assert _placements(p) and set(_placements(p)) == {Placement.GPU}


def test_large_lane_bound_tensors_stay_on_the_gpu():
    p = _plan(H200, numel=1 << 24, count=4)
    assert p.timeline.step_s > 0.105  # the lanes, not backward, end the step
    assert set(_placements(p)) == {Placement.GPU}


def _one(numel, device=H200, gbit=3.0):
    sra = next(o for o in options_for(TensorProfile("w", numel, 0.0), _model(None, gbit))
               if o.name == "sra-4bit")
    return costs(sra.compress_s, sra.decompress_s, sra.bytes_sent, numel, len(sra.wire),
                 700e9, 1300e9, 0.0, device)


def test_decide_alone_weighs_slack_against_what_the_gpu_takes():
    small = _one(1 << 16)
    assert decide([small], slack_s=0.01) is Placement.CPU_OFFLOAD
    assert decide([small], slack_s=0.0) is Placement.GPU  # no slack: the longer lanes show
    large = _one(1 << 26)
    assert decide([large], slack_s=0.001) is Placement.GPU
    slow = _one(1 << 16, DeviceProfile.h200(d2h_gbps=0.05, h2d_gbps=0.05))
    assert decide([slow], slack_s=0.001) is Placement.GPU
    # a fusion group is decided once: many small members together outgrow the slack
    assert decide([small] * 100, slack_s=0.001) is Placement.GPU
    with pytest.raises(ValueError, match="slack_s must be >= 0"):
        decide([small], slack_s=-1.0)


def test_offload_costs_pcie_and_host_time_and_takes_nothing_from_the_gpu():
    c = _one(1 << 20)
    gpu, off = c[Placement.GPU], c[Placement.CPU_OFFLOAD]
    assert off.compute_s == 0.0 and gpu.compute_s == pytest.approx(gpu.compress_s + gpu.decompress_s)
    assert off.compress_s > gpu.compress_s and off.decompress_s > gpu.decompress_s
    assert off.pcie_bytes > 2 * 4 * (1 << 20)  # the values both ways, the payloads too
    idle = _one(1 << 20, DeviceProfile.h200(gpu_busy=0.25))[Placement.GPU]
    assert idle.compute_s == pytest.approx(0.25 * gpu.compute_s)


def test_options_gain_an_offloaded_twin_sharing_the_calls():
    t = TensorProfile("w", 1 << 20, 0.0)
    plain = options_for(t, _model(None))
    placed = options_for(t, _model(H200))
    assert "sra-4bit@cpu" not in [o.name for o in plain]
    by_name = {o.name: o for o in placed}
    for name in ("sra-4bit", "allgather-4bit"):
        assert by_name[name + "@cpu"].calls == by_name[name].calls  # fused with the GPU twin
        assert by_name[name + "@cpu"].wire == by_name[name].wire
    assert [o.name for o in placed if not o.name.endswith("@cpu")] == [o.name for o in plain]
    assert by_name["exact"] == plain[0]
    # place() leaves the options it is not told are quantized to their GPU kernels' cost
    again = place(plain, frozenset(), t.numel, 700e9, 1300e9, 0.0, H200)
    assert [o.name for o in again] == [o.name for o in plain]


def test_profile_round_trips():
    p = DeviceProfile.h200(gpu_busy=0.6, threads=2, source="given")
    assert DeviceProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert pickle.loads(pickle.dumps(p)) == p
    assert p.host_gbps(p.host_quantize_gbps) == 17.64  # the 2-thread entry
    assert DeviceProfile.h200(threads=8).host_gbps(p.host_quantize_gbps) == 17.64
    assert DeviceProfile.h200(host_quantize_gbps={1: 9.0, 2: 17.0}).host_quantize_gbps == (
        (1, 9.0), (2, 17.0))
    m = _model(p)
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert "device" not in _model(None).to_dict()  # older checkpoints' shape unchanged


@pytest.mark.parametrize("overrides, match", [
    (dict(d2h_gbps=0.0), "d2h_gbps must be a finite number > 0"),
    (dict(gpu_quantize_gbps=float("nan")), "gpu_quantize_gbps must be a finite"),
    (dict(h2d_gbps="fast"), "h2d_gbps must be a finite"),
    (dict(gpu_busy=1.5), "gpu_busy is the fraction of backward"),
    (dict(threads=0), "threads must be an int >= 1"),
    (dict(host_quantize_gbps={}), "host_quantize_gbps needs at least one entry"),
    (dict(host_quantize_gbps={0: 9.0}), "thread counts >= 1"),
    (dict(host_dequantize_gbps={1: -2.0}), "host_dequantize_gbps must map thread counts"),
    (dict(copy_s=-1e-6), "copy_s is seconds per call"),
])
def test_bad_profile_values_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        DeviceProfile.h200(**overrides)


def test_bad_profile_dicts_and_models():
    with pytest.raises(ValueError, match="unknown fields"):
        DeviceProfile.from_dict(dict(H200.to_dict(), pcie_gbps=20.0))
    with pytest.raises(TypeError, match="device must be a cgx.policy.planner.placement.DeviceProfile"):
        CostModel.uniform(2, 1.0, device={"gpu_busy": 1.0})
