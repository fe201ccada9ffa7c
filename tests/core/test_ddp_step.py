"""rk.TrainStep over DistributedDataParallel (two CPU processes, gloo, emulated backend): the
two-graph form bitwise equal to eager DDP on every rank, and the ranks routing together."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import replaykit as rk
from replaykit.errors import ReplayError
from replaykit.testing.parity.ddp_step import Case, compare


def _replayed_equal(result: dict, arm: str = "trainstep") -> None:
    r = result[arm]
    assert r["equal"] and r["ranks_agree"], (result["case"], r["diffs"], r["summaries"])
    assert min(r["replay"]) >= 1, r["summaries"]  # replay coverage, not eager routes
    assert r["routes"][0] == r["routes"][1], r["routes"]


@pytest.mark.ddp
def test_trainstep_over_ddp_is_bitwise_eager_ddp_on_every_rank() -> None:
    """fp32 and bf16 autocast x accumulation 1 and 2: every rank's end state (weights, BatchNorm
    buffers, momentum, losses) equals eager DDP's, the ranks agree, and steps replayed. A DDP
    with find_unused_parameters runs eagerly, saying why, and stays equal."""
    cases = [
        Case(precision=p, accumulate=a, steps=5 if a == 1 else 4)
        for p, a in (("32", 1), ("32", 2), ("bf16-mixed", 1), ("bf16-mixed", 2))
    ]
    refused = Case(find_unused=True, steps=2)  # a reduction the step does not repeat: eager
    *results, last = compare([*cases, refused], timeout=150)
    for result in results:
        _replayed_equal(result)
    r = last["trainstep"]
    assert r["equal"] and r["replay"] == [0, 0], r
    assert all("find_unused_parameters" in s for s in r["summaries"]), r["summaries"]


@pytest.mark.ddp
def test_rank_one_alone_meets_a_rerecord_trigger_and_both_ranks_route_eager() -> None:
    """Rank 1 alone changes dropout's p at call 6 (a new recording there, a replay on rank 0):
    agreed, both ranks run that call eagerly (``peer_route``) and stay equal to eager DDP.
    With ``rank_agreement`` switched off (the unsafe arm) rank 0 replays while rank 1 records:
    the collectives no longer pair up and the result differs."""
    case = Case(arms=("native", "trainstep", "unsafe"), steps=7, rank1_change=6, replay_timeout=5.0)
    (result,) = compare([case], timeout=150, pg_timeout=10)
    _replayed_equal(result)
    routes = result["trainstep"]["routes"][0]
    assert routes[5] == "eager:peer_route" and routes[6] == "replay", routes
    unsafe = result["unsafe"]
    r0, r1 = unsafe["routes"]
    assert r0[5] == "replay" and r1[5:6] != ["replay"], unsafe["routes"]
    assert not unsafe["equal"], unsafe


@pytest.mark.e2e  # a child-process run of the harness: `make e2e` (CI runs it)
@pytest.mark.ddp
def test_a_stalled_rank_is_named_by_the_replay_watchdog() -> None:
    """Rank 1 stalls 3 s before call 5 (a replay); rank 0, with replay_timeout=1, raises a
    ReplayError naming itself and what it waited for, instead of waiting out gloo's timeout."""
    stall = Case(arms=("native", "trainstep"), steps=5, rank1_stall=5, replay_timeout=1.0)
    (result,) = compare([stall], timeout=150, pg_timeout=10)
    error = result["trainstep"]["errors"][0] or ""
    assert "rank 0 waited more than 1 s for the ranks' route agreement" in error, result
    assert result["trainstep"]["routes"][0][3] == "record", result["trainstep"]["routes"]


def test_collectives_in_graph_and_a_bad_timeout_are_refused() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def loss_fn(m, x):
        return m(x).sum()

    with pytest.raises(ReplayError, match=r"not\s+been proven on two GPUs"):
        rk.TrainStep(net, loss_fn, opt, collectives_in_graph=True)
    with pytest.raises(ReplayError, match="replay_timeout"):
        rk.TrainStep(net, loss_fn, opt, replay_timeout=0)


@pytest.mark.ddp
def test_trainstep_over_ddp_replays_on_cuda_and_refuses_a_default_stream_ddp(
    cuda_device: str,
) -> None:
    """The one-GPU stand-in (two ranks, gloo, CUDA tensors): DDP built on a side stream replays
    the two-graph form bitwise on every rank; built on the default stream (where its gradient
    accumulators then run, which a capture cannot join) every call runs eagerly, saying how to
    build it, and stays equal."""
    cases = [
        Case(precision=p, accumulate=a, device=cuda_device, steps=5 if a == 1 else 4)
        for p, a in (("32", 1), ("bf16-mixed", 2), ("16-mixed", 4))
    ]
    default = Case(device=cuda_device, steps=5, default_stream=True)
    *results, last = compare([*cases, default], timeout=240)
    for result in results:
        _replayed_equal(result)
    r = last["trainstep"]
    assert r["equal"] and r["replay"] == [0, 0], r
    assert all("ddp_default_stream" in s for s in r["summaries"]), r["summaries"]


@pytest.mark.ddp
def test_collectives_inside_the_loss_run_eagerly_and_stay_equal() -> None:
    """A loss normalised by a count all-reduced across the ranks, and a loss calling the DDP
    wrapper it closes over (whose forward broadcasts buffers and arms the reducer): a replay would
    reissue those collectives unpaired and unwaited (they replayed with other weights, silently).
    The capture refuses a collective; every call runs eagerly, saying why, equal to eager DDP."""
    cases = [Case(steps=6, loss_collective=True), Case(steps=6, loss_closure=True)]
    for result in compare(cases, timeout=150):
        r = result["trainstep"]
        assert r["equal"] and r["ranks_agree"] and r["replay"] == [0, 0], (result["case"], r)
        assert all("is a collective (torch.distributed)" in s for s in r["summaries"]), r
