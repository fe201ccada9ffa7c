"""The parity harness: does replay end where eager ends, bit for bit, over whole training runs?

    scenario     the matrix's data model (Scenario, ArmOutcome, ScenarioResult)
    end_state    snapshot a Lightning run's whole end state (weights, grads, optimizer, scaler, EMA ...)
    arms         run one scenario's arms (Lightning: eager, replay, unsafe) in this process
    ddp          ``python -m replaykit.testing.parity.ddp``: one scenario's arms as DDP processes
    matrix       build and run the scenario matrix; its rows, diff rows and summary
    trial        plain-PyTorch trials of ``rk.capture``: eager vs replay vs unsafe arms
    step_trial   plain-PyTorch trials of ``rk.TrainStep``: the same against its eager twin
    step_matrix  the whole-step arm of the matrix (Lightning tasks under ``TrainStep``)

Import the module you need; this package imports nothing on its own.
"""
