"""Hugging Face transformers models from tiny configs (no hub, no weights), trained as users do.

Each model keeps transformers' defaults (SDPA attention, ``use_cache`` as the config sets
it) and is called as ``loss = model(**batch).loss``: the batch is a dict of keyword
arguments with the labels inside, and the language models' batches are padded (the last
row's tail is masked out in ``attention_mask`` and ignored in ``labels``), as a
tokenizer's padded batch is. ``tiny`` is what the CPU tests and the parity rows run;
``small`` is a few times wider and deeper, for the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import deps
from .workload import MakeBatch, Workload

VOCAB = 96
#: the sequence length of a batch; the padded row keeps this many tokens
SEQ, KEPT = 16, 11
IGNORE = -100  # transformers' loss ignores these labels

#: width, depth, heads (and the key/value heads of Llama), per size
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"width": 32, "layers": 2, "heads": 2, "kv_heads": 1},
    "small": {"width": 256, "layers": 4, "heads": 4, "kv_heads": 2},
}


def loss(outputs: Any, targets: Any) -> torch.Tensor:
    """The model's own loss (``labels`` are in the batch): ``model(**batch).loss``."""
    return outputs.loss


def _padded(batch: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (never 0, the pad id) and an attention mask whose last row is padded."""
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, KEPT * seq // SEQ :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _to(
    device: str | torch.device, **tensors: torch.Tensor
) -> tuple[dict[str, torch.Tensor], None]:
    """Keyword arguments (``model(**batch)``) and no targets: the labels are among them."""
    return {k: v.to(device) for k, v in tensors.items()}, None


def _language(causal: bool) -> MakeBatch:
    def make(batch: int, device: str | torch.device, g: torch.Generator):
        ids, mask = _padded(batch, SEQ, g)
        if causal:  # the model shifts the labels itself
            labels = ids.masked_fill(mask == 0, IGNORE)
        else:  # masked LM: predict every fourth token, which the input hides
            hidden = torch.zeros_like(mask, dtype=torch.bool)
            hidden[:, 1::4] = True
            hidden &= mask.bool()
            labels = ids.masked_fill(~hidden, IGNORE)
            ids = ids.masked_fill(hidden, VOCAB - 1)  # the [MASK] id
        return _to(device, input_ids=ids, attention_mask=mask, labels=labels)

    return make


def _seq2seq(batch: int, device: str | torch.device, g: torch.Generator):
    ids, mask = _padded(batch, SEQ, g)
    target, target_mask = _padded(batch, SEQ // 2, g)
    labels = target.masked_fill(target_mask == 0, IGNORE)
    return _to(device, input_ids=ids, attention_mask=mask, labels=labels)


def unpadded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same batch with nothing padded: every token attended and learnt from."""
    ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 5)
    labels = batch["labels"]
    labels = ids if labels.shape == ids.shape else labels.masked_fill(labels == IGNORE, 5)
    return {**batch, "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def output_difference(a: Any, b: Any, where: str = "output") -> str | None:
    """Where two forward outputs differ, or None: type, keys and fields (a ``ModelOutput``'s, a
    cache object's attributes), constants, tensors bitwise."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        return None if torch.equal(a.detach().cpu(), b.detach().cpu()) else f"{where}: values"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} vs {list(b)}"
        pairs = [(a[k], b[k], f"{where}.{k}") for k in a]
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length"
        pairs = [(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b, strict=True))]
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        return output_difference(vars(a), vars(b), f"{where} ({type(a).__name__})")
    else:
        return None if a == b else f"{where}: {a!r} vs {b!r}"
    return next((d for x, y, w in pairs if (d := output_difference(x, y, w)) is not None), None)


def _common(size: str) -> dict[str, int]:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {list(SIZES)}")
    return SIZES[size]


#: the causal LMs' vocabulary and special tokens (padding apart from the one token that begins and ends)
_CAUSAL_TOKENS = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}


def _encoder_sizes(s: dict[str, int]) -> dict[str, int]:
    """The size keywords the BERT-style configs (BERT, Llama, ViT) name alike."""
    return {
        "hidden_size": s["width"],
        "intermediate_size": 2 * s["width"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
    }


def gpt2(size: str = "tiny") -> Workload:
    tf, s = deps.transformers(), _common(size)
    config = tf.GPT2Config(
        **_CAUSAL_TOKENS,
        n_positions=2 * SEQ,
        n_embd=s["width"],
        n_layer=s["layers"],
        n_head=s["heads"],
    )
    return Workload(tf.GPT2LMHeadModel(config), _language(causal=True), loss)


def llama(size: str = "tiny") -> Workload:
    tf, s = deps.transformers(), _common(size)
    config = tf.LlamaConfig(
        **_CAUSAL_TOKENS,
        **_encoder_sizes(s),
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=2 * SEQ,
    )
    return Workload(tf.LlamaForCausalLM(config), _language(causal=True), loss)


def bert(size: str = "tiny") -> Workload:
    tf, s = deps.transformers(), _common(size)
    config = tf.BertConfig(
        vocab_size=VOCAB,
        **_encoder_sizes(s),
        max_position_embeddings=2 * SEQ,
        pad_token_id=0,
    )
    return Workload(tf.BertForMaskedLM(config), _language(causal=False), loss)


def t5(size: str = "tiny") -> Workload:
    tf, s = deps.transformers(), _common(size)
    config = tf.T5Config(
        vocab_size=VOCAB,
        d_model=s["width"],
        d_kv=s["width"] // s["heads"],
        d_ff=2 * s["width"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return Workload(tf.T5ForConditionalGeneration(config), _seq2seq, loss)


def vit(size: str = "tiny") -> Workload:
    tf, s = deps.transformers(), _common(size)
    classes = 10
    config = tf.ViTConfig(
        image_size=32,
        patch_size=8,
        **_encoder_sizes(s),
        num_labels=classes,
    )

    def make(batch: int, device: str | torch.device, g: torch.Generator):
        x = torch.randn(batch, 3, 32, 32, generator=g)
        return _to(device, pixel_values=x, labels=torch.randint(0, classes, (batch,), generator=g))

    return Workload(tf.ViTForImageClassification(config), make, loss)


def whisper(size: str = "tiny") -> Workload:
    """An encoder-decoder over audio features: a conv front end, then padded decoder labels."""
    tf, s = deps.transformers(), _common(size)
    mels, frames = 16, 32  # the encoder's convs halve the frames to max_source_positions
    config = tf.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=mels,
        d_model=s["width"],
        encoder_layers=s["layers"],
        decoder_layers=s["layers"],
        encoder_attention_heads=s["heads"],
        decoder_attention_heads=s["heads"],
        encoder_ffn_dim=2 * s["width"],
        decoder_ffn_dim=2 * s["width"],
        max_source_positions=frames // 2,
        max_target_positions=2 * SEQ,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )

    def make(batch: int, device: str | torch.device, g: torch.Generator):
        features = torch.randn(batch, mels, frames, generator=g)
        target, target_mask = _padded(batch, SEQ // 2, g)
        labels = target.masked_fill(target_mask == 0, IGNORE)
        return _to(device, input_features=features, labels=labels)

    return Workload(tf.WhisperForConditionalGeneration(config), make, loss)


#: name stem -> (builder, what it exercises)
FAMILIES: dict[str, tuple[Callable[[str], Workload], str]] = {
    "gpt2": (gpt2, "causal LM, SDPA, padded batch, DynamicCache in its output"),
    "llama": (llama, "causal LM, RoPE, grouped-query SDPA, padded batch, DynamicCache"),
    "bert": (bert, "masked LM, bidirectional SDPA mask, padded batch"),
    "t5": (t5, "encoder-decoder, relative position bias, padded batch, EncoderDecoderCache"),
    "vit": (vit, "image classifier, config.problem_type written at the first call"),
    "whisper": (whisper, "audio encoder-decoder, conv front end, padded labels, cache"),
}
