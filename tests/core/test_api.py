"""The public API: bad input fails clearly and leaves nothing half-patched; release is clean."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import replaykit as rk
from replaykit.testing.nets import DetectionNet


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup": 0}, "warmup"),
        ({"warmup": True}, "warmup"),
        ({"max_recordings": 0}, "max_recordings"),
        ({"max_recordings": 1.5}, "max_recordings"),
        ({"backend": "tpu"}, "unknown backend"),
        ({"unsafe_disable": ("copy_out", "nonsense")}, "unknown unsafe_disable"),
        ({"unsafe_disable": "typo"}, "unknown unsafe_disable"),
    ],
)
def test_bad_arguments_raise_and_patch_nothing(kwargs: dict, match: str) -> None:
    model = DetectionNet()
    with pytest.raises(rk.ReplayError, match=match):
        rk.capture(model, **kwargs)
    assert "forward" not in model.__dict__
    assert rk.recorder_of(model) is None


def test_not_a_module() -> None:
    with pytest.raises(rk.ReplayError, match=r"nn\.Module"):
        rk.capture(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_backend_without_gpu_is_a_clear_error() -> None:
    with pytest.raises(rk.ReplayError, match="CUDA GPU"):
        rk.capture(DetectionNet(), backend="cuda")


def test_capture_twice_raises_until_released() -> None:
    model = DetectionNet()
    rec = rk.capture(model)
    assert rk.recorder_of(model) is rec
    with pytest.raises(rk.ReplayError, match="already captured"):
        rk.capture(model)
    rec.release()
    rec.release()  # idempotent
    rk.capture(model).release()


def test_release_restores_forward_and_frees(backend: str, device: str) -> None:
    model = DetectionNet().to(device)
    x = torch.randn(2, 3, 8, 8, device=device)
    with rk.capture(model, backend=backend) as rec:
        sum(o.sum() for o in model(x).values()).backward()
        sum(o.sum() for o in model(x).values()).backward()
        assert rec.recordings == 1 and rec.counts["replay"] == 1
    assert "forward" not in model.__dict__ and rk.recorder_of(model) is None
    assert rec.recordings == 0 and rec.journal[-1].kind == "release"
    model(x)  # plain eager again
    ref = weakref.ref(rec)
    del rec
    gc.collect()
    assert ref() is None  # no cycle keeps the recorder alive


def test_deepcopy_of_a_captured_module_is_plain(backend: str, device: str) -> None:
    model = DetectionNet().to(device)
    rec = rk.capture(model, backend=backend)
    x = torch.randn(2, 3, 8, 8, device=device)
    model(x)
    twin = copy.deepcopy(model)
    assert rk.recorder_of(twin) is None
    twin(x)
    assert rec.counts["record"] == 1 and rec.counts["replay"] == 0
    rec.release()


def test_counts_and_repr() -> None:
    model = DetectionNet()
    rec = rk.capture(model, backend="emulated")
    assert set(rec.counts) == set(rk.journal.KINDS)
    assert "emulated" in repr(rec)
    rec.release()


def test_unsafe_disable_warns_and_is_journaled() -> None:
    with pytest.warns(rk.ReplayWarning, match="hold"):
        rec = rk.capture(DetectionNet(), unsafe_disable=("hold",))
    assert [(e.kind, e.reason) for e in rec.journal] == [("unsafe", "hold")]
    rec.release()


def test_capturing_a_container_without_a_forward_is_refused_with_the_fix() -> None:
    """A ModuleDict (or an actor-critic holding ``pi`` and ``v``) has no forward: the loop calls its
    children, so a capture of it recorded nothing and said nothing (hostile review)."""
    nn = torch.nn
    for container in (
        nn.ModuleDict({"body": nn.Linear(4, 4), "head": nn.Linear(4, 2)}),
        nn.ModuleList([nn.Linear(4, 4)]),
    ):
        with pytest.raises(rk.ReplayError, match="no forward of its own"):
            rk.capture(container, backend="emulated")
    body = nn.ModuleDict({"body": nn.Linear(4, 4)})["body"]
    rk.capture(body, backend="emulated").release()  # its children can be captured
