"""Diagnose recurrent nets (nn.LSTM / nn.GRU / nn.RNN) under replaykit on CUDA (issue #33 class 2).

Run from the repository root on a GPU machine:  python scripts/gpu/rnn_diag.py [--quick] [--device cpu]
Prints torch/cuDNN versions, then per pattern one line per entry point and one line of probes:

  <net> <variant> <prec> TS|CAP exact=Y/N losses=k/10 rec/rep/eager {reasons} fw=.. contig=.. moved=.. flat=.. chunk=..
  <net> <variant> <prec> PROBE det snap twice stand dstate

Entries: TS (rk.TrainStep), CAP (rk.capture + a plain optimizer loop), CAPfw (CAP with stand_ins
that also point each RNN's _flat_weights at the stand-ins: the candidate fix for the flat weights).
exact: final parameters and every step's loss torch.equal to a plain eager loop (same seeds).
fw:    after the run, every ``rnn._flat_weights[i] is getattr(rnn, name)`` (Y) or not (N).
contig: the RNN's weights are views of one storage (cuDNN's flat buffer).
moved: a weight's data_ptr changed during the run (flatten_parameters ``set_``).
flat:  calls of torch._cudnn_rnn_flatten_weight during the run.  chunk: "not part of single
       contiguous chunk" warnings (cuDNN copying the weights into a fresh buffer per call).
Probes (plain eager loops compared with the eager reference):
  det    a second eager loop is equal (eager repeats itself);
  snap   a StateSnapshot taken and restored before each step changes nothing;
  twice  an extra forward+backward each step, state restored by StateSnapshot (RNG included):
         N with dropout on CUDA = cuDNN's private dropout state advanced (not in any snapshot);
  stand  the extra forward runs on detached stand-ins (recorder.stand_ins), state restored:
         N = the stand-ins' flatten_parameters changed what later steps compute;
  dstate the _cudnn_rnn dropout_state buffer the extra run advanced, restored too (then twice=Y
         means the dropout state is the whole cause and can be snapshotted via dispatch).
Every pattern runs under a SIGALRM timeout; the whole run stops starting patterns after 200 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.getcwd())

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils._python_dispatch import TorchDispatchMode

import replaykit as rk
from replaykit import recorder as recorder_module
from replaykit.recorder import stand_ins
from replaykit.verify.snapshot import StateSnapshot

STEPS, BATCH, SEQ, FEAT, HID, CLASSES = 10, 4, 6, 8, 16, 5
BUDGET_S, PATTERN_S = 200, 40


class Net(nn.Module):
    """A recurrent encoder and a per-step head; ``packed`` feeds it packed padded sequences."""

    def __init__(self, kind: str, packed: str = "", **kw: object) -> None:
        super().__init__()
        cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
        self.rnn = cls(FEAT, HID, batch_first=True, **kw)
        width = int(kw.get("proj_size", 0) or HID) * (2 if kw.get("bidirectional") else 1)
        self.head = nn.Linear(width, CLASSES)
        self.packed = packed

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            p = pack_padded_sequence(
                x, lengths, batch_first=True, enforce_sorted=self.packed == "sorted"
            )
            out, _ = pad_packed_sequence(self.rnn(p)[0], batch_first=True, total_length=SEQ)
        else:
            out = self.rnn(x)[0]
        return self.head(out)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lengths=None) -> torch.Tensor:
    out = model(x, lengths) if lengths is not None else model(x)
    return nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def batches(device: str, packed: str) -> list[tuple]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, SEQ, FEAT, generator=g)
        y = torch.randint(0, CLASSES, (BATCH, SEQ), generator=g)
        b = [x.to(device), y.to(device)]
        if packed:
            # host tensor, as pack wants; different per batch (the packed kernel reads them)
            lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=g)
            lengths[0] = SEQ
            if packed == "sorted":
                lengths = lengths.sort(descending=True).values
            b.append(lengths)
        out.append(tuple(b))
    return out


class Pattern:
    def __init__(self, kind: str, name: str, prec: str, kw: dict, extra: str = "") -> None:
        self.kind, self.name, self.prec, self.kw, self.extra = kind, name, prec, kw, extra

    @property
    def label(self) -> str:
        return f"{self.kind:4s} {self.name:10s} {self.prec:4s}"

    def model(self, device: str) -> Net:
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.manual_seed_all(0)
        packed = self.extra if self.extra in ("sorted", "unsorted") else ""
        return Net(self.kind, packed, **self.kw).to(device)

    def autocast(self, device: str):
        if self.prec == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.prec == "bf16" else torch.float16
        return torch.autocast(device, dtype=dtype)


def rnn_of(m: Net) -> nn.RNNBase:
    return m.rnn


def weights(r: nn.RNNBase) -> list[torch.Tensor]:
    return [getattr(r, n) for n in r._flat_weights_names]


def flat_weights_ok(r: nn.RNNBase) -> bool:
    return all(a is b for a, b in zip(r._flat_weights, weights(r), strict=True))


def contiguous_chunk(r: nn.RNNBase) -> bool:
    """All the RNN's weights are views of one storage (cuDNN's flat buffer)."""
    return len({w.untyped_storage().data_ptr() for w in weights(r)}) == 1


@contextlib.contextmanager
def synced_stand_ins(module: nn.Module, originals: list, leaves: list):
    """stand_ins that also points each RNN's _flat_weights (and weak refs) at the stand-ins, so
    its forward neither reassigns them nor re-flattens the stand-ins (the CAPfw arm)."""
    import weakref

    with stand_ins(module, originals, leaves):
        saved = []
        for r in module.modules():
            if isinstance(r, nn.RNNBase):
                saved.append((r, r.__dict__["_flat_weights"], r.__dict__["_flat_weight_refs"]))
                fw = weights(r)
                r.__dict__["_flat_weights"] = fw
                r.__dict__["_flat_weight_refs"] = [weakref.ref(w) for w in fw]
        try:
            yield
        finally:
            for r, fw, refs in saved:
                r.__dict__["_flat_weights"], r.__dict__["_flat_weight_refs"] = fw, refs


class Counters:
    """Counts torch._cudnn_rnn_flatten_weight calls and cuDNN's non-contiguous-weights warnings."""

    def __init__(self) -> None:
        self.flat = 0
        self.chunk = 0
        self._orig = getattr(torch, "_cudnn_rnn_flatten_weight", None)

    def __enter__(self) -> Counters:
        if self._orig is not None:

            def counted(*a, **k):
                self.flat += 1
                return self._orig(*a, **k)

            torch._cudnn_rnn_flatten_weight = counted
        self._w = warnings.catch_warnings(record=True)
        self._log = self._w.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._orig is not None:
            torch._cudnn_rnn_flatten_weight = self._orig
        self.chunk = sum("contiguous chunk" in str(w.message) for w in self._log)
        self.other = sorted(
            {str(w.message)[:90] for w in self._log if "contiguous chunk" not in str(w.message)}
        )
        self._w.__exit__(*exc)


class DropoutStates(TorchDispatchMode):
    """Finds the dropout_state buffers _cudnn_rnn is handed (ATen's private per-device cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "_cudnn_rnn" in str(func) and "backward" not in str(func) and "flatten" not in str(func):
            state = args[-1] if len(args) >= 15 else kwargs.get("dropout_state")
            if isinstance(state, torch.Tensor) and state.numel():
                self.found[state.data_ptr()] = state
        return func(*args, **kwargs)


def optimizer(m: nn.Module, device: str) -> torch.optim.Optimizer:
    """AdamW with its step counter on the device (TrainStep replays it) on CUDA; SGD on the CPU."""
    if device == "cuda":
        return torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=True, foreach=True)
    return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)


def eager_loop(p: Pattern, device: str, probe: str = "") -> tuple[list, dict, dict]:
    m = p.model(device)
    opt = optimizer(m, device)
    losses, facts = [], {}
    data = batches(device, p.extra if p.extra in ("sorted", "unsorted") else "")
    dstates: dict[int, torch.Tensor] = {}
    for i, b in enumerate(data):
        finder = DropoutStates() if probe == "dstate" and i == 0 else None
        # dstate: step 0 finds the buffers (in the real step); later steps put them back too
        if probe and not (probe == "dstate" and i == 0):
            snap = StateSnapshot(m)
            held = [s.clone() for s in dstates.values()]
            if probe in ("twice", "stand", "dstate"):
                leaves = [q.detach().requires_grad_(True) for q in m.parameters()]
                ctx = (
                    stand_ins(m, list(m.parameters()), leaves)
                    if probe == "stand"
                    else contextlib.nullcontext()
                )
                with ctx, p.autocast(device):
                    loss_fn(m, *b).backward()
            snap.restore()
            if probe == "dstate":
                for s, v in zip(dstates.values(), held, strict=True):
                    s.copy_(v)
        opt.zero_grad(set_to_none=True)
        with p.autocast(device), finder or contextlib.nullcontext():
            loss = loss_fn(m, *b)
            loss.backward()
        if finder is not None:
            dstates = finder.found
        opt.step()
        if p.extra == "val":
            validate(m, data[0])
        losses.append(loss.detach().clone())
    facts["dstates"] = len(dstates)
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}, facts


def validate(m: nn.Module, b: tuple) -> None:
    m.eval()
    with torch.no_grad():
        loss_fn(m, *b)
    m.train()


def replay_loop(p: Pattern, device: str, entry: str) -> tuple[list, dict, dict]:
    m = p.model(device)
    opt = optimizer(m, device)
    r = rnn_of(m)
    start = [w.data_ptr() for w in weights(r)]
    data = batches(device, p.extra if p.extra in ("sorted", "unsorted") else "")
    losses = []
    precision = {"fp32": "32", "bf16": "bf16-mixed", "fp16": "16-mixed"}[p.prec]
    with Counters() as c:
        if entry == "TS":
            runner = rk.TrainStep(m, loss_fn, opt, precision=precision)
            for b in data:
                losses.append(runner(*b).detach().clone())
                if p.extra == "val":
                    validate(m, data[0])
        else:
            runner = rk.capture(m)
            if entry == "CAPfw":
                recorder_module.stand_ins = synced_stand_ins
            for b in data:
                opt.zero_grad(set_to_none=True)
                with p.autocast(device):
                    loss = loss_fn(m, *b)
                loss.backward()
                opt.step()
                if p.extra == "val":
                    validate(m, data[0])
                losses.append(loss.detach().clone())
    recorder_module.stand_ins = stand_ins
    facts = {
        "counts": {
            k: v
            for k, v in runner.counts.items()
            if v and k in ("record", "replay", "eager", "retire", "rerecord", "refuse")
        },
        "reasons": dict(runner.eager_reasons),
        "retire": getattr(runner, "retire_reason", None),
        "fw": flat_weights_ok(r),
        "contig": contiguous_chunk(r),
        "moved": start != [w.data_ptr() for w in weights(r)],
        "flat": c.flat,
        "chunk": c.chunk,
        "warn": c.other,
    }
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with contextlib.suppress(Exception):
        runner.release()
    return losses, state, facts


def equal(a: tuple, b: tuple) -> tuple[bool, int]:
    la, sa = a[0], a[1]
    lb, sb = b[0], b[1]
    same_losses = sum(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    exact = same_losses == len(la) and all(torch.equal(sa[k], sb[k]) for k in sa)
    return exact, same_losses


def yn(v: bool) -> str:
    return "Y" if v else "N"


class Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise Timeout()


def run_pattern(p: Pattern, device: str, entries: list[str]) -> None:
    try:
        ref = eager_loop(p, device)
    except Exception as e:
        print(f"{p.label} EAGER ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    for entry in entries:
        t0 = time.perf_counter()
        try:
            out = replay_loop(p, device, entry)
            ex, k = equal(ref, out)
            f = out[2]
            counts = "/".join(str(f["counts"].get(n, 0)) for n in ("record", "replay", "eager"))
            extra = f" retire={f['retire']!r}"[:120] if f["retire"] else ""
            warn = f" warn={f['warn'][:2]}" if f["warn"] else ""
            print(
                f"{p.label} {entry:3s} exact={yn(ex)} losses={k}/{STEPS} rec/rep/eager={counts} "
                f"{f['reasons']} fw={yn(f['fw'])} contig={yn(f['contig'])} moved={yn(f['moved'])} "
                f"flat={f['flat']} chunk={f['chunk']}{extra}{warn} {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
        except Timeout:
            raise
        except Exception as e:
            print(f"{p.label} {entry:3s} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)
    probes = []
    for probe in ("", "snap", "twice", "stand", "dstate"):
        try:
            out = eager_loop(p, device, probe)
            probes.append(f"{probe or 'det'}={yn(equal(ref, out)[0])}")
            if probe == "dstate":
                probes.append(f"(states={out[2]['dstates']})")
        except Timeout:
            raise
        except Exception as e:
            probes.append(f"{probe}=ERR:{type(e).__name__}:{str(e)[:60]}")
    print(f"{p.label} PROBE {' '.join(probes)}", flush=True)


def patterns(quick: bool) -> list[Pattern]:
    variants = [
        ("1L", {}),
        ("2L_do.2", {"num_layers": 2, "dropout": 0.2}),
        ("2L_do0", {"num_layers": 2}),
        ("bidir", {"bidirectional": True}),
    ]
    out = []
    for kind in ("lstm", "gru", "rnn"):
        vs = variants + ([("proj4", {"proj_size": 4})] if kind == "lstm" else [])
        for prec in ("fp32", "bf16"):
            for name, kw in vs:
                if quick and (kind != "lstm" or prec != "fp32"):
                    continue
                out.append(Pattern(kind, name, prec, kw))
    for extra in ("val", "sorted", "unsorted"):
        out.append(
            Pattern(
                "lstm", f"2L_do.2+{extra}"[:10], "fp32", {"num_layers": 2, "dropout": 0.2}, extra
            )
        )
        out.append(Pattern("gru", f"1L+{extra}"[:10], "fp32", {}, extra))
    out.append(Pattern("lstm", "2L_do0", "fp16", {"num_layers": 2}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="run patterns whose label contains this")
    ap.add_argument("--entries", default="TS,CAP,CAPfw")
    args = ap.parse_args()
    rk.enable_determinism()
    print(
        f"torch {torch.__version__} cuda {torch.version.cuda} cudnn "
        f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None} "
        f"device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'} "
        f"cudnn.deterministic={torch.backends.cudnn.deterministic} allow_tf32={torch.backends.cudnn.allow_tf32}",
        flush=True,
    )
    signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    for p in patterns(args.quick):
        if args.only not in p.label:
            continue
        if time.perf_counter() - t0 > BUDGET_S:
            print(f"{p.label} SKIPPED (budget)", flush=True)
            continue
        signal.alarm(PATTERN_S)
        try:
            run_pattern(p, args.device, args.entries.split(","))
        except Timeout:
            print(f"{p.label} TIMEOUT after {PATTERN_S}s", flush=True)
        finally:
            signal.alarm(0)
    print(f"total {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
