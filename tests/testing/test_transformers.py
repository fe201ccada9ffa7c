"""Tiny transformers models under rk.capture: the output comes back as eager's own ModelOutput class
with the replayed tensors; a DynamicCache among the outputs routes that signature eagerly, naming
``use_cache=False``; the zoo's transformers rows are never silently different. Skipped without
transformers (``pip install 'replaykit[zoo]'``)."""

from __future__ import annotations

import pytest
import torch

import replaykit as rk
from replaykit.testing import zoo
from replaykit.testing.zoo import bench, hf, run
from replaykit.verify.bitwise import diff_states

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(
    make,
    batch,
    device: str,
    calls: int = 3,
    config: dict | None = None,
    attention: str | None = None,
    **capture,
):
    """Train from one seed on ``calls`` batches; every call's output and the end state."""
    torch.manual_seed(0)
    module = make().module
    for k, v in (config or {}).items():
        setattr(module.config, k, v)
    if attention is not None:
        module.set_attn_implementation(attention)
    module = module.to(device).train()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    rec = rk.capture(module, **capture) if capture else None
    outputs, state = [], {}
    g = torch.Generator().manual_seed(1)
    for i in range(calls):
        kwargs = {k: v.to(device) for k, v in batch(g).items()}
        out = module(**kwargs)
        out.loss.backward()
        state.update({f"grad{i}/{n}": p.grad.clone() for n, p in module.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        outputs.append(out)
    state.update({n: p.detach().clone() for n, p in module.named_parameters()})
    return outputs, state, rec


#: no pad token: without a mask, transformers looks for one in the ids on the host
NO_PAD = {"pad_token_id": None}


def _lm(g: torch.Generator) -> dict[str, torch.Tensor]:
    """No attention mask, no padding: the mask builders' host read (``.all()``) and the pad-token
    check retire today (input-derived host reads become a key in another change)."""
    ids = torch.randint(1, hf.VOCAB, (2, hf.SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _padded(g: torch.Generator) -> dict[str, torch.Tensor]:
    return hf._language(causal=True)(2, "cpu", g)[0]


def _causal(padded: bool):
    return _padded if padded else lambda g: hf.unpadded(_padded(g))


def _seq2seq(padded: bool):
    def make(g: torch.Generator) -> dict[str, torch.Tensor]:
        batch = hf._seq2seq(2, "cpu", g)[0]
        return batch if padded else hf.unpadded(batch)

    return make


def _mlm(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, hf.VOCAB - 1, (2, hf.SEQ), generator=g)
    labels = torch.full_like(ids, hf.IGNORE)
    labels[:, 1::4] = ids[:, 1::4]
    return {"input_ids": ids.masked_fill(labels != hf.IGNORE, hf.VOCAB - 1), "labels": labels}


def _image(g: torch.Generator) -> dict[str, torch.Tensor]:
    return hf.vit().make_batch(2, "cpu", g)[0]


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_a_model_with_its_default_cache_replays_and_returns_an_equal_cache(
    backend: str, device: str, family: str, padded: bool
) -> None:
    """Default config (``use_cache`` on): the ModelOutput and its DynamicCache / EncoderDecoderCache
    come back as eager's, rebuilt around the replayed tensors, one new cache per call."""
    make = getattr(hf, family)
    batch = _seq2seq(padded) if family == "t5" else _causal(padded)
    eager_out, eager, _ = _train(make, batch, device, calls=4)
    out, state, rec = _train(make, batch, device, calls=4, backend=backend)
    assert diff_states(eager, state) == []
    assert rec.counts["replay"] >= 2 and "output_object" not in rec.eager_reasons, (
        rec.journal.format()
    )
    for e, r in zip(eager_out, out, strict=True):  # every call's output, kept: each its own values
        assert hf.output_difference(e, r) is None, hf.output_difference(e, r)
    caches = [o.past_key_values for o in out]
    assert type(caches[0]).__name__ in ("DynamicCache", "EncoderDecoderCache")
    assert len({id(c) for c in caches}) == len(caches)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_causal_lm_without_the_cache_replays_its_model_output(
    backend: str, device: str, family: str
) -> None:
    make = getattr(hf, family)
    # the padded batch with its mask, and eager attention: SDPA's mask check reads the host
    settings = {"use_cache": False}
    eager_out, eager, _ = _train(make, _padded, device, config=settings, attention="eager")
    out, state, rec = _train(
        make, _padded, device, config=settings, attention="eager", backend=backend
    )
    assert diff_states(eager, state) == []
    if backend == "cuda":
        # eager attention copies a host tensor to the GPU inside forward, which a CUDA capture
        # refuses: the first call runs eagerly, later ones are fed (backends/host_feeds.py)
        assert rec.eager_reasons["host_feeds"] == 1 and not rec.retired, rec.journal.format()
        assert rec.counts["record"] == 1 and rec.counts["replay"] >= 1, rec.journal.format()
    else:
        assert rec.counts["record"] == 1 and rec.counts["replay"] == 2, rec.journal.format()
    for e, r in zip(eager_out, out, strict=True):
        assert type(r) is type(e) and list(r.keys()) == list(e.keys()) == ["loss", "logits"]
        assert torch.equal(r.loss, e.loss) and torch.equal(r.logits, e.logits)
        assert r.past_key_values is None and r.hidden_states is None


def test_bert_masked_lm_replays_its_model_output(backend: str, device: str) -> None:
    eager_out, eager, _ = _train(hf.bert, _mlm, device)
    out, state, rec = _train(hf.bert, _mlm, device, backend=backend)
    assert diff_states(eager, state) == [] and rec.counts["replay"] == 2, rec.journal.format()
    assert type(out[-1]).__name__ == "MaskedLMOutput" and out[-1].attentions is None
    assert torch.equal(out[-1].logits, eager_out[-1].logits)


def test_vit_replays_its_model_output(backend: str, device: str) -> None:
    """``problem_type`` set up front: ViT writes it at its first call with labels (first-call
    config writes are handled in another change)."""
    settings = {"problem_type": "single_label_classification"}
    eager_out, eager, _ = _train(hf.vit, _image, device, config=settings)
    out, state, rec = _train(hf.vit, _image, device, config=settings, backend=backend)
    assert diff_states(eager, state) == [] and rec.counts["replay"] == 2, rec.journal.format()
    assert type(out[-1]).__name__ == "ImageClassifierOutput"
    assert torch.equal(out[-1].logits, eager_out[-1].logits)


def test_the_zoo_names_and_builds_every_transformers_model() -> None:
    assert zoo.names(["transformers"]) == [f"hf_{f}" for f in hf.FAMILIES]
    assert len(zoo.names(["transformers_small"])) == len(hf.FAMILIES)
    for name in zoo.names(["transformers"]):
        assert zoo.unavailable(name) is None
        torch.manual_seed(0)
        module, make_batch, loss = zoo.build(name)
        kwargs, targets = make_batch(2, "cpu", torch.Generator().manual_seed(0))
        assert isinstance(kwargs, dict) and targets is None
        if "attention_mask" in kwargs:  # a padded batch: the last row's tail is masked out
            assert kwargs["attention_mask"][0].all() and not kwargs["attention_mask"][-1].all()
        value = loss(zoo.invoke(module.train(), kwargs), targets)
        assert value.dim() == 0 and torch.isfinite(value), name


@pytest.mark.parametrize("api", run.APIS)
@pytest.mark.parametrize("model", ["hf_gpt2", "hf_vit"])
def test_zoo_rows_are_equal_to_eager_and_say_whether_they_replayed(model: str, api: str) -> None:
    """Default settings (SDPA, use_cache, padded batches): whatever replays is bitwise; a row that
    ran eagerly says why and does not count as replayed."""
    result = run.run_case(run.ZooCase(model, "32", 1, steps=3, api=api))
    row = run.rows([result])[0]
    assert not result.silent and not result.failed and not result.diffs, result.verdict
    assert row["replayed"] == (result.verdict == "bitwise") == (row["replays"] > 0)
    if not row["replayed"]:
        assert result.verdict.startswith(("eager:", "retired:")), result.verdict
    assert run.summary([result])["replayed"] == int(row["replayed"])


def test_the_zoo_benchmark_times_both_apis_and_counts_only_replayed_rows() -> None:
    """A keyword-argument model has no make_graphed_callables arm; TrainStep is an arm of its own; an
    arm that ran eagerly is timed but not counted as replayed. (CPU times predict nothing.)"""
    results = bench.bench_model("hf_bert", "32", 2, torch.device("cpu"), steps=7, rounds=1)
    rows = bench.table(results)
    assert [r["arm"] for r in rows] == ["eager", "replaykit", "replaykit step"]
    assert all(r["equals_eager"] for r in rows), rows
    line = bench.summary(rows)
    assert line["replaykit_rows"] == 2
    assert line["replayed"] == sum(
        r["note"].startswith("replays=") and not r["note"].startswith("replays=0") for r in rows
    )
