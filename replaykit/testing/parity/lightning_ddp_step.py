"""``whole_step`` under Lightning's DDP strategy (manual optimization) against native Lightning DDP.

    python -m replaykit.testing.parity.lightning_ddp_step [--device cuda] [--precision 16-mixed] [--accumulate 2]

The driver starts ``world`` processes (gloo; on a GPU host every rank uses ``cuda:0``: the
one-GPU stand-in for two GPUs, through ``DDPStrategy(parallel_devices=...)``). Each rank fits
every arm one after another, ``Trainer(strategy=DDPStrategy(...), precision="32")``, from one
seed, on its own shard of the batches:

- ``native``: Lightning's manual optimization written out: autocast around the loss,
  ``loss / accumulate``, the user's GradScaler, ``manual_backward`` (inside
  ``trainer.strategy.block_backward_sync()`` on accumulation micro-batches), unscale, clip,
  the optimizer's step (``LightningOptimizer.step``; ``scaler.step`` under 16-mixed),
  ``zero_grad(set_to_none=True)``;
- ``whole_step``: ``replaykit.lightning.whole_step(self, self.net, loss_fn, ...)`` called in
  ``training_step``: replayed from graphs, DDP's all-reduce between them;
- ``unsafe``: the same with the ``rank_agreement`` protection switched off;
- with ``rank1_change`` rank 1 alone changes dropout's ``p`` for one call (a re-record trigger on
  rank 1 alone); with ``find_unused`` DDP finds unused parameters, a reduction the step does not
  repeat: ``whole_step`` raises ReplayError on every rank (kept as the arm's error).

Under 16-mixed native steps with ``scaler.step(optimizer)`` (the GradScaler's own call, which
Lightning's optimizer wrapper does not count), so its ``global_step`` stays 0; the step's counts.

Each arm's end state (weights, BatchNorm buffers, momentum, losses) is compared with native's bit
for bit on every rank, and the ranks' weights with each other; each call's route is kept per rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .ddp_step import end_state, harness_main, judge_arm, launch_ranks, loss_fn, routes


@dataclass(frozen=True)
class Case:
    """One fit of every arm on every rank."""

    precision: str = "32"
    accumulate: int = 1
    device: str = "cpu"
    steps: int = 4  # optimizer steps
    world: int = 2
    arms: tuple[str, ...] = ("native", "whole_step")
    rank1_change: int = 0  # the call at which rank 1 alone changes dropout.p (0: never)
    find_unused: bool = False  # DDPStrategy(find_unused_parameters=...): whole_step raises
    width: int = 32
    batch: int = 8


def _net(case: Case) -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, case.width),
        nn.BatchNorm1d(case.width),
        nn.ReLU(),
        nn.Linear(case.width, case.width),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(case.width, 4),
    )


def _module(case: Case, arm: str) -> Any:
    """The LightningModule of ``arm`` (built here: Lightning is imported by the ranks alone)."""
    import lightning as L

    from replaykit.lightning import whole_step
    from replaykit.step_config import PRECISIONS

    class ManualDDP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _net(case)
            self.automatic_optimization = False
            self.losses: list[torch.Tensor] = []
            self.step: Any = None

        def configure_optimizers(self) -> Any:
            # a GradScaler steps a fused optimizer without reading found_inf on the host
            fused = case.precision == "16-mixed" or None
            return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9, fused=fused)

        def on_train_start(self) -> None:
            self.scaler = (
                torch.amp.GradScaler(case.device) if case.precision == "16-mixed" else None
            )
            if arm != "native":
                self.step = whole_step(
                    self, self.net, loss_fn, scaler=self.scaler, max_norm=1.0,
                    accumulate=case.accumulate, precision=case.precision, warmup=1,
                    backend="emulated" if case.device == "cpu" else "auto",
                    unsafe_disable=("rank_agreement",) if arm == "unsafe" else (),
                )  # fmt: skip
            torch.manual_seed(1 + self.global_rank)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            if case.rank1_change and self.global_rank == 1:
                self.net[-2].p = 0.2 if batch_idx + 1 == case.rank1_change else 0.1
            run = self.native if self.step is None else self.step
            self.losses.append(run(*batch) if self.step is not None else run(batch, batch_idx))

        def native(self, batch: Any, batch_idx: int) -> torch.Tensor:
            acc, scaler, lopt = case.accumulate, self.scaler, self.optimizers()
            sync = (batch_idx + 1) % acc == 0
            dtype = PRECISIONS[case.precision]
            ac = torch.autocast(case.device, dtype=dtype) if dtype else contextlib.nullcontext()
            with ac:
                loss = loss_fn(self.net, *batch)
            scaled = loss / acc if acc > 1 else loss
            scaled = scaler.scale(scaled) if scaler is not None else scaled
            quiet = self.trainer.strategy.block_backward_sync
            with quiet() if not sync else contextlib.nullcontext():
                self.manual_backward(scaled)
            if sync:
                if scaler is not None:
                    scaler.unscale_(lopt.optimizer)
                params = [p for p in self.net.parameters() if p.grad is not None]
                nn.utils.clip_grad_norm_(params, 1.0, foreach=True, error_if_nonfinite=False)
                if scaler is not None:
                    scaler.step(lopt.optimizer)
                    scaler.update()
                else:
                    lopt.step()
                lopt.zero_grad(set_to_none=True)
            return loss.detach()

    return ManualDDP()


def _loader(case: Case, rank: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    n = case.steps * case.accumulate * case.batch
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=case.batch)


def _trainer(case: Case) -> Any:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from .one_device import OneDeviceEnvironment

    # every rank a node of one device (cuda:0 on a GPU host): the automatic matrix's stand-in
    # (one_device.py); Lightning's CUDA accelerator would put rank 1 on cuda:1 otherwise
    strategy = DDPStrategy(
        cluster_environment=OneDeviceEnvironment(), process_group_backend="gloo",
        find_unused_parameters=case.find_unused,
    )  # fmt: skip
    return L.Trainer(
        strategy=strategy, accelerator="cpu" if case.device == "cpu" else "cuda",
        devices=1, num_nodes=case.world, max_epochs=1, precision="32", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip


def _arm(case: Case, arm: str) -> dict[str, Any]:
    """One arm's fit on this rank: end state, each call's route, what it replayed."""
    import torch.distributed as dist

    rank = dist.get_rank()
    module, trainer = _module(case, arm), _trainer(case)
    error = None
    try:
        trainer.fit(module, _loader(case, rank))
    except Exception as exc:  # the unsafe arm's unpaired collective: kept, judged by the driver
        error = f"{type(exc).__name__}: {exc}"
    info: dict[str, Any] = {"global_step": trainer.global_step}
    step = module.step
    if step is not None:
        info.update(routes=routes(step), replay=step.counts["replay"], summary=step.summary())
        step.release()
    lopt = module.optimizers()
    if isinstance(
        lopt, list
    ):  # fit raised before Lightning set the optimizer up: the error says why
        return {"state": {}, "error": error or "fit configured no optimizer", **info}
    state = end_state(module.net, lopt.optimizer, module.losses)
    return {"state": state, "error": error, **info}


def _run_case(data: dict) -> dict:
    case = Case(**{**data, "arms": tuple(data["arms"])})
    return {arm: _arm(case, arm) for arm in case.arms}


def compare(cases: list[Case], timeout: float = 120, pg_timeout: float = 60) -> list[dict]:
    """Per case: every arm against native on every rank, the ranks' weights against each other.
    Every arm of every case runs in the same ``world`` processes; past ``timeout`` all are killed."""
    module = "replaykit.testing.parity.lightning_ddp_step"
    per_rank = launch_ranks(module, cases, timeout, pg_timeout, "Lightning DDP whole_step")
    return [_judge(case, [r[i] for r in per_rank]) for i, case in enumerate(cases)]


def _judge(case: Case, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every arm (native too: its ranks must agree) against native, rank by rank."""
    out: dict[str, Any] = {"case": asdict(case)}
    for arm in case.arms:
        out[arm] = {**judge_arm(ranks, arm), "global_step": [r[arm]["global_step"] for r in ranks]}
    return out


def main(argv: list[str] | None = None) -> int:
    def one(precision: str, accumulate: int, device: str, timeout: float) -> dict:
        return compare([Case(precision, accumulate, device)], timeout)[0]

    return harness_main(argv, __doc__, _run_case, one, "whole_step", 120)


if __name__ == "__main__":
    raise SystemExit(main())
