"""Why rk.TrainStep's two-graph form fails to capture under DDP on CUDA (one-GPU stand-in).

    python -m scripts.gpu.ddp_cuda_diag [--precision 32] [--accumulate 1]

Runs ``replaykit.testing.parity.ddp_step``'s trainstep arm with the CUDA refusal lifted and
prints, per rank, every capture failure's exception with its traceback (the first one is the
cause; a retry after it reads "a previous error during capture"), then the arm's verdict.
"""

from __future__ import annotations

import argparse
import os
import traceback


def _patch() -> None:
    import replaykit.step as step_mod
    import replaykit.step_recording as rec_mod
    from replaykit.guards import distributed

    original = distributed.ddp_refusal
    step_mod.ddp_refusal = lambda model, cuda=False: original(model, False)
    failed = rec_mod.RecordingSteps._capture_failed

    def loud(self, a, exc, watch):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        rank = dist.get_rank()
        with open(os.path.join(os.environ.get("DIAG_OUT", "/tmp"), f"rank{rank}.log"), "a") as f:
            print(f"[rank {rank}] capture failed at call {self._calls}:", file=f)
            traceback.print_exception(exc, file=f)
        return failed(self, a, exc, watch)

    rec_mod.RecordingSteps._capture_failed = loud
    if "DIAG_SIDE" in os.environ:  # 1: DDP built on a side stream, as torch's docs ask
        import torch

        ddp_class = torch.nn.parallel.DistributedDataParallel

        def on_side_stream(*args, **kwargs):  # type: ignore[no-untyped-def]
            side = torch.cuda.Stream()
            if os.environ["DIAG_SIDE"] != "1":
                side = torch.cuda.current_stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ddp = ddp_class(*args, **kwargs)
            torch.cuda.current_stream().wait_stream(side)
            probe = next(p for p in ddp.module.parameters() if p.requires_grad)
            seen: list[bool] = []

            def hook(p):  # type: ignore[no-untyped-def]
                seen.append(torch.cuda.current_stream() == torch.cuda.default_stream())
                if len(seen) <= 2:
                    log = os.path.join(os.environ.get("DIAG_OUT", "/tmp"), "hook.log")
                    with open(log, "a") as f:
                        print(f"accumulate on the default stream: {seen[-1]}", file=f)

            probe.register_post_accumulate_grad_hook(hook)
            return ddp

        torch.nn.parallel.DistributedDataParallel = on_side_stream


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--precision", default="32")
    ap.add_argument("--accumulate", type=int, default=1)
    args, _ = ap.parse_known_args()
    from pathlib import Path

    from replaykit.testing.parity import ddp_step

    if args.worker:
        _patch()
        ddp_step._worker(Path(args.worker))
        return 0
    from replaykit.testing.parity.plain_ddp import run_ranks

    ddp_step.run_ranks = lambda module, a, world, timeout, what: run_ranks(
        "scripts.gpu.ddp_cuda_diag", a, world, timeout, what
    )
    cases = [
        ddp_step.Case(p, a, "cuda", steps=5 if a == 1 else 4)
        for p in ("32", "bf16-mixed", "16-mixed")
        for a in (1, 2, 4)
    ]
    try:
        results = ddp_step.compare(cases, timeout=240)
    except RuntimeError as exc:
        print(str(exc)[-6000:])
        return 1
    for result in results:
        t = result["trainstep"]
        c = result["case"]
        print(c["precision"], c["accumulate"], "equal", t["equal"], "agree", t["ranks_agree"])
        print("   replay", t["replay"], t["routes"], t["errors"])
    for r in ("hook", 0, 1):
        log = os.path.join(
            os.environ.get("DIAG_OUT", "/tmp"), f"rank{r}.log" if r != "hook" else "hook.log"
        )
        if os.path.exists(log):
            with open(log) as f:
                print(f.read()[-5000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
