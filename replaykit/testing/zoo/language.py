"""A small causal transformer language model with tied embeddings (torch only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .workload import Workload

VOCAB = 64
CONTEXT = 16


class TinyLM(nn.Module):
    """Token + learned position embeddings, a pre-norm nn.TransformerEncoder under a causal mask,
    and an output projection that shares the embedding's weight."""

    def __init__(
        self,
        vocab: int = VOCAB,
        context: int = CONTEXT,
        dim: int = 32,
        layers: int = 2,
        heads: int = 2,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(1, context, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, 2 * dim, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.embed(tokens) + self.position[:, :n]
        return self.head(self.norm(self.encoder(h, mask=mask, is_causal=True)))


def transformer_lm() -> Workload:
    def make(batch: int, device, g: torch.Generator):
        t = torch.randint(0, VOCAB, (batch, CONTEXT + 1), generator=g).to(device)
        return (t[:, :-1],), t[:, 1:]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return Workload(TinyLM(), make, loss)
