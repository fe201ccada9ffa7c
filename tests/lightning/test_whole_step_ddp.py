"""whole_step under Lightning's DDP strategy (manual optimization, two ranks, gloo): bitwise equal
to native Lightning DDP on every rank, the ranks routing together."""

from __future__ import annotations

import pytest

from replaykit.errors import ReplayError
from replaykit.testing.parity.lightning_ddp_step import Case, compare

#: every precision and accumulation once (the full 3 x 3 matrix: scripts/gpu/lightning_ddp_check.py)
CASES = (("32", 2), ("bf16-mixed", 4), ("16-mixed", 1))


def _replayed_equal(result: dict, arm: str = "whole_step") -> None:
    r = result[arm]
    assert result["native"]["ranks_agree"], result["native"]
    assert r["equal"] and r["ranks_agree"], (
        result["case"],
        r["diffs"],
        r["errors"],
        r["summaries"],
    )
    assert min(r["replay"]) >= 1, r["summaries"]  # replay coverage, not eager routes
    assert r["routes"][0] == r["routes"][1], r["routes"]


@pytest.fixture(scope="module")
def cpu_results() -> list[dict]:
    """One launch: the three cases, then rank 1's change with the unsafe arm last (its unpaired
    collective ends the process group)."""
    cases = [Case(precision=p, accumulate=a) for p, a in CASES]
    unused = Case(find_unused=True, steps=1)
    change = Case(arms=("native", "whole_step", "unsafe"), steps=6, rank1_change=4)
    return compare([*cases, unused, change], timeout=240, pg_timeout=10)


@pytest.mark.ddp
def test_whole_step_under_lightning_ddp_is_native_lightning_ddp_on_every_rank(cpu_results):
    """fp32, bf16 autocast and fp16 with a GradScaler x accumulation 1, 2, 4 (BatchNorm, dropout,
    clipping, SGD with momentum): every rank's weights, buffers, momentum and losses equal native
    Lightning manual-optimization DDP's, the ranks' weights agree, steps replayed on both ranks,
    and the step ticks Lightning's global_step."""
    for result in cpu_results[:3]:
        _replayed_equal(result)
        assert result["whole_step"]["global_step"] == [4, 4], result["whole_step"]


@pytest.mark.ddp
def test_whole_step_refuses_a_ddp_reduction_it_does_not_repeat(cpu_results):
    """DDPStrategy(find_unused_parameters=True): the step's eager backward would arm the default
    reducer, not Lightning's unused-parameter search, so whole_step raises on every rank."""
    errors = cpu_results[3]["whole_step"]["errors"]
    assert all("ReplayError" in e and "find_unused_parameters" in e for e in errors), errors


@pytest.mark.ddp
def test_rank_one_alone_changes_dropout_and_both_ranks_route_eager(cpu_results):
    """Rank 1 alone changes dropout's p at call 4 (a new recording there, a replay on rank 0):
    agreed, both ranks run it eagerly (``peer_route``) and stay equal to native. With
    ``rank_agreement`` off (the unsafe arm) rank 0 replays while rank 1 does not: the
    collectives no longer pair up and the result differs."""
    result = cpu_results[-1]
    _replayed_equal(result)
    routes = result["whole_step"]["routes"][0]
    assert routes[3] == "eager:peer_route" and routes[4:] == ["replay", "replay"], routes
    unsafe = result["unsafe"]
    r0, r1 = unsafe["routes"]
    assert r0[3] == "replay" and r1[3] != "replay", unsafe["routes"]
    assert not unsafe["equal"], unsafe


@pytest.mark.ddp
def test_whole_step_under_lightning_ddp_replays_on_cuda(cuda_device: str) -> None:
    """The one-GPU stand-in (two ranks, gloo, CUDA tensors on cuda:0; Lightning builds DDP on a
    side stream): the same cases replay the two-graph form bitwise on every rank."""
    cases = [Case(precision=p, accumulate=a, device=cuda_device, steps=5) for p, a in CASES]
    for result in compare(cases, timeout=300):
        _replayed_equal(result)


def test_ddp_keyword_takes_a_ddp_wrapper():
    import torch
    from torch import nn

    import replaykit as rk

    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ReplayError, match="ddp= takes the DistributedDataParallel wrapper"):
        rk.TrainStep(net, lambda m, x: m(x).sum(), opt, ddp=nn.Sequential(net))
