"""H200: host data copied to the GPU inside a step (backends/host_feeds.py).

1. transformers GPT-2 and Llama with ``attn_implementation="eager"`` (retired on the H200 before
   the feeds: a host-to-device copy inside forward) under ``rk.capture`` and ``rk.TrainStep``,
   bitwise against an eager twin, with the replay counts.
2. The negative control of the rule that a source computed on the host is never fed: with the
   rule switched off, ``test_a_mask_computed_on_the_host_is_not_frozen`` must differ.
Prints one line per case; exit 1 on a failure."""

from __future__ import annotations

import copy
import sys

import torch

import replaykit as rk

transformers = __import__("transformers")
transformers.logging.set_verbosity_error()
DEV = "cuda"


def _model(name: str) -> torch.nn.Module:
    common = {"vocab_size": 32, "bos_token_id": 1, "eos_token_id": 2}
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_embd=16,
            n_layer=1,
            n_head=2,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            pad_token_id=0,
            **common,
        )
        cls = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).to(DEV)


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(3, 32, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    if i % 2:
        mask[1, 5:] = 0
    return {"input_ids": ids.to(DEV), "attention_mask": mask.to(DEV), "labels": ids.to(DEV)}


def _run(name: str, api: str, steps: int = 8) -> bool:
    eager = _model(name)
    model = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if api == "step":
        runner = rk.TrainStep(model, lambda m, b: m(**b).loss, opt)
    else:
        runner = rk.capture(model)
    same = True
    for i in range(steps):
        b = _batch(i)
        opt_e.zero_grad(set_to_none=True)
        want = eager(**b).loss
        want.backward()
        opt_e.step()
        if api == "step":
            got = runner(b)
        else:
            opt.zero_grad(set_to_none=True)
            got = model(**b).loss
            got.backward()
            opt.step()
        same &= torch.equal(want.detach(), got.detach())
    same &= all(
        torch.equal(p, q) for p, q in zip(eager.parameters(), model.parameters(), strict=True)
    )
    print(f"{name:5} {api:7} eager-attention bitwise={same} | {runner.summary()}", flush=True)
    return same


def _negative_control() -> bool:
    sys.path.insert(0, "tests/core")
    import test_cuda_host_feeds as t

    from replaykit.backends import host_feeds

    kept = host_feeds._HostCopies._outlives

    def fed_anyway(self, source):  # the computed rule switched off
        return (
            isinstance(source, torch.Tensor)
            and source.device.type == "cpu"
            and not source.is_pinned()
        )

    host_feeds._HostCopies._outlives = fed_anyway
    try:
        t.test_a_mask_computed_on_the_host_is_not_frozen(DEV)
        differs = False
    except AssertionError:
        differs = True
    finally:
        host_feeds._HostCopies._outlives = kept
    print(f"negative control (computed sources fed): differs={differs}", flush=True)
    return differs


if __name__ == "__main__":
    ok = all([_run(n, a) for n in ("gpt2", "llama") for a in ("capture", "step")])
    ok &= _negative_control()
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)
