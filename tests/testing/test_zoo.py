"""The model zoo on the CPU: two models end bitwise equal to eager, the comparator catches a difference,
what replaykit cannot replay is a row with its reason, and the zoo imports nothing until asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replaykit.testing import zoo
from replaykit.testing.zoo import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads stall whenever the other
    core is busy (a 50 ms ResNet step took 2 s). Every arm of a case runs under the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fresh_process() -> dict:
    """What one new interpreter saw: the modules importing the zoo's runner loaded, then whether
    asking every model's availability changed sys.path or imported torchvision (one child for
    both tests: each child imports torch again, seconds on a loaded machine)."""
    code = (
        "import json, sys\n"
        "import replaykit.testing.zoo.run\n"
        "from replaykit.testing import zoo\n"
        "imported, before = sorted(sys.modules), list(sys.path)\n"
        "[zoo.unavailable(n) for n in zoo.MODELS]\n"
        "asked = {'sys.path unchanged': sys.path == before, 'torchvision': 'torchvision' in sys.modules}\n"
        "print(json.dumps({'imported': imported, 'asked': asked}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.splitlines()[-1])


def _needs(model: str) -> None:
    """The zoo's own availability check (torchvision may sit in the venv's zoo-site, see zoo.deps)."""
    why = zoo.unavailable(model)
    if why:
        pytest.skip(why)


def test_registry_names_and_lazy_imports(fresh_process: dict) -> None:
    assert zoo.names(["all"]) == list(zoo.MODELS)
    assert zoo.names(["transformer_lm", "resnet18"]) == [
        "resnet18",
        "transformer_lm",
    ]  # registry order
    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo.names(["resnet1000"])
    loaded = {m.split(".")[0] for m in fresh_process["imported"]}
    assert not loaded & {"torchvision", "timm", "lightning", "transformers"}


@pytest.mark.parametrize(
    "case",
    [
        run.ZooCase("transformer_lm", "32", 2),
        run.ZooCase("transformer_lm", "bf16-mixed", 1),
        run.ZooCase("resnet18", "32", 2, steps=2),
    ],
    ids=lambda c: c.name,
)
def test_zoo_models_end_bitwise_equal_to_eager(case: run.ZooCase) -> None:
    _needs(case.model)
    result = run.run_case(case)
    assert result.verdict == "bitwise", (result.verdict, result.diffs[:3])
    row = run.rows([result])[0]
    assert row["bitwise"] and row["records"] == 1 and row["retired"] is None
    assert (
        row["replays"] == case.steps * case.accumulation - 1
    )  # every call after the recording replayed
    assert not result.silent and not result.failed


def test_the_comparator_catches_a_difference() -> None:
    """Negative control: copy-out switched off under accumulation: the replayed gradients are overwritten."""
    result = run.run_case(run.ZooCase("transformer_lm", "32", 2), unsafe=("copy_out",))
    assert result.silent and result.verdict.startswith("DIFFERS"), result.verdict
    assert any(d.name.startswith("grad/") for d in result.diffs)
    assert run.summary([result])["silent"] == ["transformer_lm/32/acc2"]


@pytest.mark.slow  # a ResNet-18 RetinaNet in bf16 on the CPU: seconds a step
def test_a_shared_head_under_autocast_is_routed_eager_with_its_reason() -> None:
    """RetinaNet's head runs over five FPN levels: eager casts its weights once (autocast's cache), a
    recording per use, so replay would differ in the last bits; the probe routes it eager instead."""
    _needs("retinanet")
    # one image a step (a CPU bf16 step of two took 3 s): the second call still shows the routing
    result = run.run_case(run.ZooCase("retinanet", "bf16-mixed", 1, steps=2, batch=1))
    assert result.verdict.startswith("eager: autocast_shared_weight"), result.verdict
    assert not result.diffs and "head.classification_head" in result.verdict


def test_a_missing_package_is_a_row_not_a_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run, "unavailable", lambda name: "timm is not installed")
    result = run.run_case(run.ZooCase("timm_vit"))
    assert result.verdict == "skipped: timm is not installed" and not result.failed
    assert run.rows([result])[0]["bitwise"] is False


def test_cases_span_model_precision_accumulation() -> None:
    cases = run.cases(["resnet18", "transformer_lm"], ["32", "bf16-mixed"], [1, 2], steps=2)
    assert len(cases) == 8 and {c.steps for c in cases} == {2}
    with pytest.raises(ValueError, match="precision"):
        run.train(run.ZooCase("transformer_lm", precision="8-bit"))


def test_unpadded_and_mixed_batches_are_rows_of_the_language_models_only() -> None:
    cases = run.cases(["resnet18", "hf_gpt2"], paddings=["padded", "unpadded", "mixed"], steps=2)
    assert sorted(c.padding for c in cases if c.model == "resnet18") == ["padded", "padded"]
    assert {c.padding for c in cases if c.model == "hf_gpt2"} == {"padded", "unpadded", "mixed"}
    pytest.importorskip("transformers")
    result = run.run_case(run.ZooCase("hf_gpt2", accumulation=1, steps=2, padding="mixed"))
    row = run.rows([result])[0]
    assert row["model"] == "hf_gpt2 (mixed)" and row["bitwise"] is True, row


def test_every_model_builds_a_batch_its_loss_reads() -> None:
    for name in zoo.MODELS:
        if zoo.unavailable(name):
            continue
        torch.manual_seed(0)
        module, make_batch, loss = zoo.build(name)
        args, targets = make_batch(2, "cpu", torch.Generator().manual_seed(0))
        value = loss(zoo.invoke(module, args), targets)
        assert value.dim() == 0 and torch.isfinite(value), name


def test_the_command_line_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--models", "transformer_lm", "--accumulations", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "transformer_lm" in out and "bitwise" in out and "silent differences: 0" in out


def test_asking_whether_a_model_is_available_changes_nothing(fresh_process: dict) -> None:
    """Only building a zoo model may put zoo-site on sys.path: torchmetrics (so Lightning) imports any
    torchvision it can find, and the index's CUDA build fails beside a CPU torch unless the zoo imports it."""
    assert fresh_process["asked"] == {"sys.path unchanged": True, "torchvision": False}
