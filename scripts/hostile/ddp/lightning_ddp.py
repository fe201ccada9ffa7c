"""Hostile Lightning DDP: ``whole_step`` in user LightningModules under Trainer(strategy="ddp").

    python scripts/hostile/ddp/lightning_ddp.py [scenario ...]

Each scenario is fit on 2 gloo CPU ranks in three arms (one launch per arm): ``native``
(manual optimization written out: manual_backward, block_backward_sync, clip, step),
``twin`` (whole_step(..., replay=False)) and ``replay`` (whole_step, emulated backend).
End states (params, grads, buffers, optimizer state, lr, losses) compared bit for bit per rank.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import diff, end_state, launch, step_info  # noqa: E402

ARMS = ("native", "twin", "replay")


def _net():
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4)
    )


def make_module(arm: str, sc: dict):
    import lightning as L

    from replaykit.lightning import whole_step

    acc = sc.get("accumulate", 1)

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = _net()
            self.head = nn.Linear(4, 4) if sc.get("head") else None
            self.automatic_optimization = False
            self.losses: list = []
            self.vals: list = []
            self.step = None
            self.calls = 0

        def forward(self, x):
            return self.net(x)

        def loss_fn(self, net, x, y):
            out = self(x) if sc.get("self_call") else net(x)
            if self.head is not None:
                out = self.head(out)
            if sc.get("global_norm"):  # normalised by the count over every rank
                n = torch.tensor(float(len(y)))
                dist.all_reduce(n)
                return nn.functional.cross_entropy(out, y, reduction="sum") / n
            return nn.functional.cross_entropy(out, y)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if sc.get("sched"):
                return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]
            return opt

        def on_train_start(self):
            if arm != "native":
                self.step = whole_step(
                    self, self.net, self.loss_fn, max_norm=1.0, accumulate=acc,
                    replay=arm == "replay", backend="emulated",
                )  # fmt: skip
            torch.manual_seed(1 + self.global_rank)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.step(x, y) if self.step is not None else self.native(x, y)
            self.losses.append(loss)
            self.calls += 1
            if sc.get("sched") and self.calls % acc == 0:
                self.lr_schedulers().step()

        def native(self, x, y):
            lopt = self.optimizers()
            sync = (self.calls + 1) % acc == 0  # counted across epochs, as the step counts calls
            loss = self.loss_fn(self.net, x, y)
            scaled = loss / acc if acc > 1 else loss
            cm = (
                self.trainer.strategy.block_backward_sync()
                if not sync
                else contextlib.nullcontext()
            )
            with cm:
                self.manual_backward(scaled)
            if sync:
                ps = [
                    p
                    for p in dict.fromkeys(
                        [*self.net.parameters(), *lopt.optimizer.param_groups[0]["params"]]
                    )
                    if p.grad is not None
                ]
                nn.utils.clip_grad_norm_(ps, 1.0, foreach=True, error_if_nonfinite=False)
                lopt.step()
                lopt.zero_grad(set_to_none=True)
            return loss.detach()

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.vals.append(self.loss_fn(self.net, x, y).detach())

    return M()


def loaders(sc: dict, rank: int):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(100 + rank)
    n = sc.get("n", 36)
    x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=8)  # 36: a last batch of 4
    if not sc.get("val"):
        return train, None
    xv, yv = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    return train, DataLoader(TensorDataset(xv, yv), batch_size=8)


SCENARIOS: dict[str, dict] = {
    "l_base_2epochs_lastsmall": {"epochs": 2},
    "l_val_each_epoch": {"epochs": 3, "val": True},
    "l_head_outside_net": {"epochs": 2, "head": True},
    "l_sched_steplr": {"epochs": 2, "sched": True},
    "l_loss_calls_self": {"epochs": 2, "self_call": True},  # loss_fn ignores net, calls self(x)
    "l_global_norm_in_loss": {"epochs": 2, "global_norm": True},
    "l_accum2_odd_epoch": {"epochs": 2, "accumulate": 2, "n": 40},  # 5 batches an epoch
}


def run_arm(name: str, arm: str, out: Path) -> None:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    sc = SCENARIOS[name]
    rank = dist.get_rank()
    result: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            module = make_module(arm, sc)
            trainer = L.Trainer(
                strategy=DDPStrategy(process_group_backend="gloo"), accelerator="cpu",
                devices=2, max_epochs=sc.get("epochs", 1), precision="32", logger=False,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, use_distributed_sampler=False,
                num_sanity_val_steps=0,
            )  # fmt: skip
            train, val = loaders(sc, rank)
            trainer.fit(module, train, val)
            opt = trainer.optimizers[0]
            result["state"] = end_state(
                module, opt, module.losses, {"vals": module.vals, "gs": trainer.global_step}
            )
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"[:700]
            result["tb"] = traceback.format_exc()[-2500:]
        result["warnings"] = sorted(
            {
                f"{x.category.__name__}: {str(x.message)[:200]}"
                for x in w
                if "Replay" in x.category.__name__
            }
        )
    result["steps"] = step_info([module.step] if getattr(module, "step", None) else [])
    torch.save(result, out / f"{name}.{arm}.rank{rank}.pt")


def worker(name: str, arm: str, out: Path) -> None:
    # Lightning finds the process group initialised and keeps it
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        run_arm(name, arm, out)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        worker(argv[1], argv[2], Path(argv[3]))
        return 0
    names = argv or list(SCENARIOS)
    import harness

    harness.__file__  # noqa: B018
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name in names:
            t0 = time.monotonic()
            print(f"=== {name}", flush=True)
            for arm in ARMS:
                prob = _launch(name, arm, out)
                if prob:
                    print(f"  {arm}: LAUNCH PROBLEM {prob[:800]}")
            per = {
                arm: [
                    torch.load(f, weights_only=False)
                    if (f := out / f"{name}.{arm}.rank{r}.pt").exists()
                    else None
                    for r in range(2)
                ]
                for arm in ARMS
            }
            for arm in ARMS:
                for r, rr in enumerate(per[arm]):
                    if rr is None:
                        print(f"  {arm} rank{r}: no result")
                        continue
                    if rr["error"]:
                        print(
                            f"  {arm} rank{r}: ERROR {rr['error'][:400]}\n{rr.get('tb', '')[-800:]}"
                        )
                    for st in rr["steps"]:
                        c = {k: v for k, v in st["counts"].items() if v}
                        print(f"  {arm} rank{r}: counts={c} reasons={st['reasons']}")
                    if rr["warnings"]:
                        print(f"  {arm} rank{r}: warnings={rr['warnings'][:3]}")
            for arm in ("twin", "replay"):
                for r in range(2):
                    a, b = per["native"][r], per[arm][r]
                    if a and b and "state" in a and "state" in b:
                        d = diff(a["state"], b["state"])
                        print(
                            f"  {arm} vs native rank{r}: {'BITWISE' if not d else f'DIFF {len(d)}: {d[:8]}'}"
                        )
            for r in range(2):
                a, b = per["twin"][r], per["replay"][r]
                if a and b and "state" in a and "state" in b:
                    d = diff(a["state"], b["state"])
                    print(
                        f"  replay vs twin rank{r}: {'BITWISE' if not d else f'DIFF {len(d)}: {d[:8]}'}"
                    )
            print(f"  [{time.monotonic() - t0:.0f}s]", flush=True)
    return 0


def _launch(name: str, arm: str, out: Path) -> str | None:
    """harness.launch runs harness.py; here the worker is this file."""
    import harness

    saved = harness.__file__
    harness.__file__ = __file__
    try:
        return launch(name, arm, out, 240.0)
    finally:
        harness.__file__ = saved


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
