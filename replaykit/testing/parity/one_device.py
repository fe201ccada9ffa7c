"""Every DDP rank on one device: the stand-in for two GPUs when a host has one.

Under ``torchrun --nproc_per_node=N`` each process says it is node ``RANK`` with one device
(``local_rank`` 0), so Lightning puts every rank on the first device (``cuda:0``, or the CPU)
and DDP all-reduces over gloo, which accepts CUDA tensors from several processes on one GPU
(NCCL does not). Collectives, the reducer and the replayed graphs run as under true
multi-GPU DDP; only the transport differs.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy


class OneDeviceEnvironment(TorchElasticEnvironment):
    """torchrun's environment with each rank presented as a node of one device."""

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()


def one_device_trainer_args(ranks: int) -> dict[str, Any]:
    """``Trainer`` arguments that run ``ranks`` torchrun processes on one device over gloo."""
    strategy = DDPStrategy(cluster_environment=OneDeviceEnvironment(), process_group_backend="gloo")
    return {"strategy": strategy, "devices": 1, "num_nodes": ranks}


def one_device_option(ap: argparse.ArgumentParser) -> None:
    """``--one-device``: the launchers' switch onto this stand-in."""
    ap.add_argument(
        "--one-device",
        action="store_true",
        help="every rank on the first device over gloo (the stand-in for a host with one GPU)",
    )
