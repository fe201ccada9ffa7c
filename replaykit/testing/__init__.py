"""The test harness (extra ``testing``), named after ``torch.testing``: does replay end where eager ends?

    hazards/  the hazard catalogue (one module per hazard class) and its runner:
              ``python -m replaykit.testing.hazards --backend emulated [--unsafe]``
    parity/   whole training runs eager vs replayed: plain-PyTorch trials (``rk.capture``,
              ``rk.TrainStep``), the Lightning scenario matrix, its DDP runner, end-state snapshots
    bench/    step times and memory: network replay, the whole step, Lightning's loop, host overhead
    nets      small networks that exercise replay (DetectionNet, DropoutNet)
    tasks/    synthetic Lightning tasks (detection, pose, oriented, segmentation) and their data
    zoo/      torchvision and timm networks built from code, trained eager vs replayed
    plots     the notebooks' tables and figures (pandas, matplotlib: extra ``notebooks``)
    demo      ``python -m replaykit.testing.demo``: a parity table and a journal, no notebook

The bitwise comparator itself is core (``replaykit.verify.bitwise``): the shadow check uses it.
Import the module you need; this package imports nothing on its own.
"""
