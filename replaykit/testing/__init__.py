"""The parity harness (extra ``testing``), named after ``torch.testing``: does replay end where eager ends?

    end_state   snapshot a Lightning run's whole end state (weights, grads, optimizer, scaler, EMA ...)
    nets        small networks that exercise replay (DetectionNet, DropoutNet)
    trial       plain-PyTorch trials: eager vs replay vs unsafe arms over a few steps
    tasks/      synthetic Lightning tasks (detection, pose, oriented, segmentation) and their data
    scenario    the matrix's data model (Scenario, ArmOutcome, ScenarioResult)
    parity      run one scenario's arms in this process
    ddp         run one scenario's arms as DDP processes under torchrun
    matrix      build and run the scenario matrix; its rows, diff rows and summary
    bench       replay vs eager step times and memory
    plots       the notebooks' tables and figures (pandas, matplotlib: extra ``notebooks``)
    demo        ``python -m replaykit.testing.demo``: a parity table and a journal, no notebook

The bitwise comparator itself is core (``replaykit.bitwise``): the shadow check uses it.
Import the module you need; this package imports nothing on its own.
"""
