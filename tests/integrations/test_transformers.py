"""Hugging Face transformers models (tiny, from configs: no hub) replay bitwise on padded, unpadded and
mixed batches, under ``rk.TrainStep`` and ``rk.capture``; without the protections they diverge."""

from __future__ import annotations

import copy

import pytest
import torch

import replaykit as rk
from replaykit.protections import negative_control

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 32  # vocabulary
PADDED, UNPADDED = True, False
# micro-batch pairs (accumulate=2): after the warm-up, each phase records each kind once, then replays
MIXED = (PADDED, UNPADDED) * 2 + (UNPADDED, PADDED) + (PADDED, UNPADDED) + (UNPADDED, PADDED)


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=V,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def _vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTForImageClassification(config)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        vocab_size=V,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


MODELS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "vit": _vit, "t5": _t5}


def _batch(name: str, padded: bool, i: int, device: str) -> dict:
    g = torch.Generator().manual_seed(i)
    if name == "vit":
        batch = {
            "pixel_values": torch.randn(2, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 3, (2,), generator=g),
        }
    else:
        ids = torch.randint(3, V, (2, 6), generator=g)
        mask = torch.ones(2, 6, dtype=torch.long)
        if padded:
            mask[1, 4:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
    return {k: v.to(device) for k, v in batch.items()}


def _loss(model: torch.nn.Module, **batch: torch.Tensor) -> torch.Tensor:
    return model(**batch).loss


def _adamw(model: torch.nn.Module, device: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=device == "cuda")


def _pair(name: str, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = MODELS[name]().to(device).train()
    return model, copy.deepcopy(model)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _train_step(
    name: str, backend: str, device: str, kinds, unsafe=()
) -> tuple[bool, rk.TrainStep]:
    """AdamW, clipping, accumulation 2 under rk.TrainStep against its eager twin: every loss and the end state."""
    model, twin = _pair(name, device)
    kw = {"max_norm": 1.0, "accumulate": 2}
    step = rk.TrainStep(
        model, _loss, _adamw(model, device), backend=backend, unsafe_disable=unsafe, **kw
    )
    eager = rk.TrainStep(twin, _loss, _adamw(twin, device), replay=False, **kw)
    same = True
    for i, padded in enumerate(kinds):
        batch = _batch(name, padded, i, device)
        same &= torch.equal(step(**batch), eager(**batch))
    return same and _same(model, twin), step


def _train_captured(name: str, backend: str, device: str, kinds, unsafe=()) -> tuple[bool, object]:
    """The plain loop (AdamW, clipping, accumulation 2) with the model captured, against an eager copy."""
    model, twin = _pair(name, device)
    recorder = rk.capture(model, backend=backend, unsafe_disable=unsafe)
    opts = {model: _adamw(model, device), twin: _adamw(twin, device)}
    same = True
    for i, padded in enumerate(kinds):
        batch = _batch(name, padded, i, device)  # default use_cache: the cache is rebuilt per call
        losses = []
        for m, opt in opts.items():
            loss = m(**batch).loss
            (loss / 2).backward()
            losses.append(loss.detach().clone())
            if i % 2:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        same &= torch.equal(*losses)
    return same and _same(model, twin), recorder


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "bert"])
def test_padded_and_unpadded_batches_replay_bitwise_under_train_step(
    backend: str, device: str, name: str
) -> None:
    same, step = _train_step(name, backend, device, MIXED)
    assert same, step.journal.format()
    assert step.counts["retire"] == 0 and "diverged" not in step.eager_reasons, step.summary()
    # the warm-up step, then one recording per phase (first, last) and kind (padded, unpadded); the rest replay
    assert step.counts["record"] == 4 and step.counts["replay"] == len(MIXED) - 6, step.summary()


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert"])
def test_padded_and_unpadded_batches_replay_bitwise_under_capture(
    backend: str, device: str, name: str
) -> None:
    same, recorder = _train_captured(name, backend, device, MIXED)
    assert same, recorder.journal.format()
    assert not recorder.retired and recorder.counts["record"] == 2, recorder.summary()
    # each recording's call runs eagerly (BERT's tied embedding: a weight read twice is first used
    # eagerly, watched for a second call), and BERT's first call writes its config once
    assert recorder.counts["replay"] >= len(MIXED) - 3, recorder.summary()


@pytest.mark.parametrize("api", ["step", "capture"])
def test_vit_writes_its_config_once_then_replays(backend: str, device: str, api: str) -> None:
    """ViT sets config.problem_type at its first call with labels: that call runs eagerly, later ones replay."""
    train = _train_step if api == "step" else _train_captured
    same, entry = train("vit", backend, device, (PADDED,) * 6)
    assert same, entry.journal.format()
    assert not entry.retired and entry.counts["replay"] >= 2, entry.summary()


def test_without_input_reads_a_padded_recording_replays_unpadded_batches_differently() -> None:
    same, step = _train_step(
        "llama", "emulated", "cpu", MIXED[:8], unsafe=negative_control("input_reads")
    )
    assert not same, step.summary()


def test_without_capture_branches_an_unpadded_recording_differs_from_eager() -> None:
    """Under a capture transformers builds an explicit mask where eager passes is_causal=True."""
    same, step = _train_step(
        "llama", "emulated", "cpu", (UNPADDED,) * 4, unsafe=negative_control("capture_branches")
    )
    assert not same, step.summary()


def test_transformers_sees_no_capture_only_while_recording() -> None:
    utils = transformers.utils.import_utils
    original = utils.is_cuda_stream_capturing
    same, step = _train_step("bert", "emulated", "cpu", (UNPADDED,) * 4)
    assert same and step.counts["record"] == 2, step.summary()
    assert utils.is_cuda_stream_capturing is original
