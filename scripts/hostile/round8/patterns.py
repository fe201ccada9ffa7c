"""Hostile round 8: held `.grad` buffers (views, `.data`, references) under rk.capture / TrainStep,
with the storage swap (this torch) and without it (torch 2.11: the recorder gives the buffer away).

Run: OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round8/patterns.py [prefix...]
Prefixes: c_ control, z_ zero_grad(set_to_none=False) loops, m_ mixed/midway changes,
p_ shared pools / several entry points, g_ garbage collection.
The harness is scripts/hostile/harness.py (profile ROUND8, each pattern under storage_swap on/off).
"""

from __future__ import annotations

import copy
import gc
import sys
import types
import weakref
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import replaykit as rk

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import ROUND8, run_pattern, select, storage_swap

STEPS = 8
D = 8
C = 4


def batches(n=STEPS, b=6, seed=1, sizes=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        bb = sizes[i % len(sizes)] if sizes else b
        out.append((torch.randn(bb, D, generator=g), torch.randint(0, C, (bb,), generator=g)))
    return out


def mlp():
    return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, C))


OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgdm": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgdm_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}

KEEP = {
    "view": lambda g: g.view(-1),
    "data": lambda g: g.data,
    "ref": lambda g: g,
    "slice": lambda g: g[0],
    "t": lambda g: g.t() if g.dim() == 2 else g,
}


def kloop(
    r,
    opt="sgdm",
    keep="view",
    which=None,
    zero="opt",
    sizes=None,
    clip=None,
    acc=1,
    none_at=None,
    load_at=None,
    eval_between=False,
    twice=False,
    cap=None,
    gather_once=False,
    history=False,
    pre_add=None,
    steps=STEPS,
    freeze_at=None,
    grad_none_at=None,
):
    """A loop keeping views of `.grad`; snapshots params, grads, opt state, losses and everything
    kept (values, whether each shares the current `.grad`'s memory) after every step."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), **({"warmup": 1} | (cap or {})))
    params = list(model.parameters())
    o = OPTS[opt](params)
    idx = list(range(len(params))) if which is None else which
    kept, norms, saved = [], [], None
    for i, (x, y) in enumerate(batches(steps, sizes=sizes)):
        if none_at is not None and i >= none_at:
            o.zero_grad(set_to_none=True)
        elif zero == "opt":
            o.zero_grad(set_to_none=False)
        elif zero == "model":
            model.zero_grad(set_to_none=False)
        elif zero == "manual":
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
        elif zero == "kept":
            for k in kept:
                k.zero_()
        elif zero == "foreach":
            gs = [p.grad for p in params if p.grad is not None]
            if gs:
                torch._foreach_zero_(gs)
        if grad_none_at is not None and i == grad_none_at:
            params[0].grad = None
        if freeze_at is not None and i == freeze_at:
            params[0].requires_grad_(False)
        if pre_add is not None and i > 0 and kept:
            for k, p in zip(kept, [params[j] for j in idx], strict=False):
                k.add_(p.detach().reshape(k.shape) if k.shape == p.shape else 0.01)
        if load_at is not None and i == load_at:
            model.load_state_dict(saved[0])
            o.load_state_dict(saved[1])
        if load_at is not None and i == 1:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(o.state_dict()))
        losses = []
        xs = [x[j::acc] for j in range(acc)]
        ys = [y[j::acc] for j in range(acc)]
        for xb, yb in zip(xs, ys, strict=False):
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            if twice:
                loss = loss + model(xb[:2] * 0.5).pow(2).mean()
            (loss / acc).backward()
            losses.append(loss.detach())
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(params, 0.05)
        elif clip == "kept" and kept:
            tot = torch.stack([k.norm() for k in kept]).norm()
            for k in kept:
                k.mul_(torch.clamp(0.5 / (tot + 1e-6), max=1.0))
        if history and kept:
            norms.append(torch.stack([k.norm() for k in kept]))
        o.step()
        if not gather_once or not kept:
            fresh = [KEEP[keep](params[j].grad) for j in idx if params[j].grad is not None]
            kept = fresh if not history else kept[:0] + fresh
        if eval_between:
            with torch.no_grad():
                model.eval()
                ev = model(x[:3])
                model.train()
        else:
            ev = None
        share = [
            k.data_ptr() == params[j].grad.data_ptr() if params[j].grad is not None else None
            for k, j in zip(kept, idx, strict=False)
        ]
        r.snap(model, o, loss=losses, kept=list(kept), norms=list(norms), share=share, ev=ev)


# ============================================================================ controls
def c_sgd_set_to_none(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        o.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        o.step()
        r.snap(model, o, loss=loss)


def c_adamw_default_warmup(r):
    torch.manual_seed(0)
    model = r.wrap(mlp())
    o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches():
        o.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        o.step()
        r.snap(model, o, loss=loss)


def c_clip_two_shapes(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(sizes=[6, 4]):
        o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        o.step()
        r.snap(model, o, n=n)


def c_outputs_list(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for x, y in batches():
        o.zero_grad()
        out = model(x)
        outs.append(out)
        F.cross_entropy(out, y).backward()
        o.step()
        r.snap(model, o, outs=list(outs))


def c_accumulate_set_to_none(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches()):
        F.cross_entropy(model(x), y).div(2).backward()
        if i % 2:
            o.step()
            o.zero_grad()
        r.snap(model, o)


def c_eval_between(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        o.step()
        with torch.no_grad():
            ev = model(x)
        r.snap(model, o, ev=ev)


def c_trainstep_sgd(r):
    torch.manual_seed(0)
    m = mlp()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    s = r.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), o)
    for b in batches():
        r.snap(m, o, loss=s(*b))


def c_trainstep_acc2_clip(r):
    torch.manual_seed(0)
    m = mlp()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s = r.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), o, accumulate=2, max_norm=0.5)
    for b in batches():
        r.snap(m, o, loss=s(*b))


def c_dropout_bn(r):
    torch.manual_seed(0)
    model = r.wrap(
        nn.Sequential(
            nn.Linear(D, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, C)
        ),
        warmup=1,
    )
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        o.step()
        r.snap(model, o)


def c_grad_norm_history_copies(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    hist = []
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        hist.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
        o.step()
        r.snap(model, o, hist=list(hist))


# ============================================================================ zero_grad(False) loops
def z_sgdm_view(r):
    kloop(r, "sgdm", "view")


def z_sgdm_data(r):
    kloop(r, "sgdm", "data")


def z_sgdm_ref(r):
    kloop(r, "sgdm", "ref")


def z_sgdm_slice(r):
    kloop(r, "sgdm", "slice")


def z_sgdm_transpose(r):
    kloop(r, "sgdm", "t")


def z_adamw_view(r):
    kloop(r, "adamw", "view")


def z_adamw_fused_data(r):
    kloop(r, "adamw_fused", "data")


def z_amsgrad_view(r):
    kloop(r, "adamw_amsgrad", "view")


def z_adagrad_view(r):
    kloop(r, "adagrad", "view")


def z_rmsprop_data(r):
    kloop(r, "rmsprop", "data")


def z_foreach_sgd_view(r):
    kloop(r, "sgdm_foreach", "view")


def z_model_zero_grad(r):
    kloop(r, "sgdm", "view", zero="model")


def z_manual_zero(r):
    kloop(r, "sgdm", "view", zero="manual")


def z_zero_through_kept(r):
    kloop(r, "sgdm", "view", zero="kept")


def z_foreach_zero(r):
    kloop(r, "sgdm", "data", zero="foreach")


def z_no_zero_ever(r):
    kloop(r, "sgd", "view", zero="never")


def z_only_first_param(r):
    kloop(r, "sgdm", "view", which=[0])


def z_only_last_bias(r):
    kloop(r, "adamw", "data", which=[3])


def z_clip_norm(r):
    kloop(r, "sgdm", "view", clip="norm")


def z_clip_value(r):
    kloop(r, "sgdm", "data", clip="value")


def z_clip_through_kept(r):
    kloop(r, "sgdm", "view", clip="kept", gather_once=True)


def z_gather_once_data(r):
    kloop(r, "sgdm", "data", gather_once=True)


def z_gather_once_view_adamw(r):
    kloop(r, "adamw", "view", gather_once=True)


def z_norm_history(r):
    kloop(r, "sgdm", "view", history=True, gather_once=True)


def z_write_into_kept_before_backward(r):
    kloop(r, "sgd", "view", pre_add=True, gather_once=True)


def z_two_shapes(r):
    kloop(r, "sgdm", "view", sizes=[6, 4])


def z_three_shapes_data(r):
    kloop(r, "adamw", "data", sizes=[6, 4, 2])


def z_called_twice_per_step(r):
    kloop(r, "sgdm", "view", twice=True)


def z_acc2(r):
    kloop(r, "sgdm", "view", acc=2)


def z_acc3_data(r):
    kloop(r, "adamw", "data", acc=3)


def z_acc2_gather_once(r):
    kloop(r, "sgdm", "view", acc=2, gather_once=True)


def z_max_rerecords0(r):
    kloop(r, "sgdm", "view", cap={"max_rerecords": 0})


def z_default_warmup(r):
    kloop(r, "sgdm", "view", cap={"warmup": 3})


def z_check_every(r):
    kloop(r, "sgdm", "data", cap={"check_every": 1})


def z_max_recordings1_two_shapes(r):
    kloop(r, "sgdm", "view", sizes=[6, 4], cap={"max_recordings": 1})


def z_eval_between(r):
    kloop(r, "sgdm", "view", eval_between=True)


def z_multi_backward(r):
    kloop(r, "sgdm", "view", cap={"multi_backward": True}, twice=True)


# ============================================================================ midway changes
def m_set_to_none_from_3(r):
    kloop(r, "sgdm", "view", none_at=3)


def m_set_to_none_from_3_data_once(r):
    kloop(r, "sgdm", "data", none_at=3, gather_once=True)


def m_load_state_midway(r):
    kloop(r, "sgdm", "view", load_at=4)


def m_load_state_midway_adamw_once(r):
    kloop(r, "adamw", "data", load_at=4, gather_once=True)


def m_freeze_first_midway(r):
    kloop(r, "sgdm", "view", freeze_at=4, gather_once=True)


def m_one_grad_none_midway(r):
    kloop(r, "sgdm", "view", grad_none_at=4, gather_once=True)


def m_view_taken_before_backward(r):
    """The view is taken after the forward, before its backward (a backward pending)."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = []
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=False)
        out = model(x)
        if i:
            kept.append(model[0].weight.grad.view(-1))
        F.cross_entropy(out, y).backward()
        o.step()
        r.snap(model, o, kept=list(kept))


def m_flat_grad_buffer(r):
    """Apex/DDP-style: `.grad` set to views of one flat buffer before the first backward."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    off = 0
    for p in params:
        p.grad = flat[off : off + p.numel()].view_as(p)
        off += p.numel()
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for x, y in batches():
        flat.zero_()
        F.cross_entropy(model(x), y).backward()
        n = flat.norm()
        o.step()
        r.snap(model, o, flat=flat, n=n)


def m_handwritten_optimizer(r):
    """A hand-written momentum SGD gathering [p.grad.data] once (OptimizerStep-like, flat views)."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    grads, bufs = None, [torch.zeros_like(p) for p in params]
    for x, y in batches():
        if grads is not None:
            torch._foreach_zero_(grads)
        F.cross_entropy(model(x), y).backward()
        if grads is None:
            grads = [p.grad.data for p in params]
        with torch.no_grad():
            torch._foreach_mul_(bufs, 0.9)
            torch._foreach_add_(bufs, grads)
            torch._foreach_add_([p.data for p in params], bufs, alpha=-0.1)
        r.snap(model, None, bufs=list(bufs), grads=list(grads))


def m_handwritten_flat_views(r):
    """The optimizer keeps flattened views `g.view(-1)` and cats them for the norm."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    flat = None
    norms = []
    for x, y in batches():
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        F.cross_entropy(model(x), y).backward()
        if flat is None:
            flat = [p.grad.view(-1) for p in params]
        norms.append(torch.cat(flat).norm())
        with torch.no_grad():
            for p, g in zip(params, flat, strict=False):
                p.sub_(0.1 * g.view_as(p))
        r.snap(model, None, norms=list(norms), flat=list(flat))


def m_kept_data_then_set_to_none_history(r):
    """set_to_none=True loop keeping `.data` of every step's grad (each its own gradient)."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kept = []
    for x, y in batches():
        o.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        o.step()
        kept.append(model[2].weight.grad.data)
        r.snap(model, o, kept=list(kept))


def m_alternate_set_to_none(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = []
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=bool(i % 3 == 2))
        F.cross_entropy(model(x), y).backward()
        o.step()
        kept.append(model[0].bias.grad.view(-1))
        r.snap(model, o, kept=list(kept))


def m_scaler_like_unscale_in_place(r):
    """A manual loss scale: backward of loss*1024, then the kept views are divided in place."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        (F.cross_entropy(model(x), y) * 1024).backward()
        if kept is None:
            kept = [p.grad.view(-1) for p in params]
        torch._foreach_div_(kept, 1024.0)
        o.step()
        r.snap(model, o, kept=list(kept))


def m_autocast_bf16_view(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = []
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        o.step()
        kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept), loss=loss)


# ============================================================================ pools, several entry points
def _probe_step(r, pool):
    torch.manual_seed(5)
    probe = mlp()
    po = torch.optim.SGD(probe.parameters(), lr=0.1)
    kw = {"pool": pool} if pool is not None else {}
    return probe, po, r.step(probe, lambda mm, x, y: F.cross_entropy(mm(x), y), po, **kw)


def p_pool_capture_and_trainstep(r):
    pool = r.pool()
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1, **({"pool": pool} if pool is not None else {}))
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    probe, _po, s = _probe_step(r, pool)
    kept = []
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        kept = [p.grad.view(-1) for p in model.parameters()]
        pl = s(x, y)
        r.snap([model, probe], o, kept=list(kept), pl=pl)


def p_pool_two_captures(r):
    pool = r.pool()
    kw = {"pool": pool} if pool is not None else {}
    torch.manual_seed(0)
    a = r.wrap(mlp(), warmup=1, **kw)
    b = r.wrap(mlp(), warmup=1, **kw)
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    ka = kb = None
    for x, y in batches():
        oa.zero_grad(set_to_none=False)
        ob.zero_grad(set_to_none=False)
        F.cross_entropy(a(x), y).backward()
        F.cross_entropy(b(x), y).backward()
        oa.step()
        ob.step()
        if ka is None:
            ka = [p.grad.data for p in a.parameters()]
            kb = [p.grad.view(-1) for p in b.parameters()]
        r.snap([a, b], oa, ka=list(ka), kb=list(kb))


def p_two_captures_no_pool_shared_view_norm(r):
    torch.manual_seed(0)
    a = r.wrap(mlp(), warmup=1)
    b = r.wrap(nn.Linear(C, C), warmup=1)
    o = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(b(a(x)), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in list(a.parameters()) + list(b.parameters())]
        r.snap([a, b], o, kept=list(kept), n=torch.cat(kept).norm())


def p_capture_then_trainstep_same_model(r):
    """The same model under rk.capture in a hand loop (held views), then under a TrainStep."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches(4):
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))
    if r.rk:
        r.entries[0].release()
    s = r.step(model, lambda mm, x, y: F.cross_entropy(mm(x), y), o)
    for b in batches(4, seed=2):
        r.snap(model, o, loss=s(*b), kept=list(kept))


def _shared_encoder(r, order="ab", acc=1):
    torch.manual_seed(0)
    enc = nn.Linear(D, 16)
    ha, hb = nn.Linear(16, C), nn.Linear(16, C)
    ma, mb = nn.Sequential(enc, nn.ReLU(), ha), nn.Sequential(enc, nn.ReLU(), hb)
    oa = torch.optim.SGD(ma.parameters(), lr=0.1, momentum=0.9)
    ob = torch.optim.SGD(hb.parameters(), lr=0.1)
    lf = lambda mm, x, y: F.cross_entropy(mm(x), y)  # noqa: E731
    sa = r.step(ma, lf, oa, accumulate=acc)
    sb = r.step(mb, lf, ob)
    for x, y in batches():
        if order == "ab":
            la, lb = sa(x, y), sb(x, y)
        else:
            lb, la = sb(x, y), sa(x, y)
        r.snap(
            [ma, hb],
            oa,
            la=la,
            lb=lb,
            eg=[enc.weight.grad.view(-1)] if enc.weight.grad is not None else [],
        )


def p_shared_encoder_ab(r):
    _shared_encoder(r, "ab")


def p_shared_encoder_ba(r):
    _shared_encoder(r, "ba")


def p_shared_encoder_acc2(r):
    _shared_encoder(r, "ab", acc=2)


def p_shared_encoder_held_view(r):
    """A's loop keeps the encoder's gradient view B hands out, read after every step."""
    torch.manual_seed(0)
    enc = nn.Linear(D, 16)
    ma, mb = (
        nn.Sequential(enc, nn.ReLU(), nn.Linear(16, C)),
        nn.Sequential(enc, nn.Tanh(), nn.Linear(16, C)),
    )
    oa = torch.optim.SGD(ma.parameters(), lr=0.1)
    ob = torch.optim.SGD(mb[2].parameters(), lr=0.1)
    lf = lambda mm, x, y: F.cross_entropy(mm(x), y)  # noqa: E731
    sa, sb = r.step(ma, lf, oa), r.step(mb, lf, ob)
    kept = []
    for x, y in batches():
        lb = sb(x, y)
        kept.append(enc.weight.grad.view(-1))
        la = sa(x, y)
        r.snap([ma, mb], oa, la=la, lb=lb, kept=list(kept))


# ============================================================================ garbage
class GcNet(nn.Module):
    def __init__(self, collect=False):
        super().__init__()
        self.net = mlp()
        self.collect = collect
        self.cycle = [self]  # a cycle: only the collector frees it

    def forward(self, x):
        if self.collect:
            gc.collect()
        return self.net(x)


def _cycle_capture(r, collect, warmup=1):
    m = GcNet(collect)
    if r.rk:
        RECS[id(m)] = weakref.ref(rk.capture(m, backend="emulated", warmup=warmup))
    return m


RECS: dict = {}


def _note(r, m):
    if r.rk:
        r.note(RECS[id(m)]())


def g_delete_model_midway(r):
    torch.manual_seed(0)
    outs, kept = [], []
    for phase in range(2):
        m = _cycle_capture(r, collect=phase == 1)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches(4, seed=phase + 1):
            o.zero_grad(set_to_none=False)
            out = m(x)
            outs.append(out)
            F.cross_entropy(out, y).backward()
            o.step()
            kept.append(m.net[0].weight.grad.view(-1))
            r.snap(m.net, o, outs=list(outs), kept=list(kept))
        _note(r, m)
        del m, o


def g_delete_model_midway_no_collect(r):
    torch.manual_seed(0)
    outs = []
    for phase in range(3):
        m = _cycle_capture(r, collect=False)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        for x, y in batches(3, seed=phase + 1):
            o.zero_grad()
            out = m(x)
            outs.append(out)
            F.cross_entropy(out, y).backward()
            o.step()
            if phase == 2:
                gc.collect()
            r.snap(m.net, o, outs=list(outs))
        _note(r, m)
        del m, o


def g_collect_inside_forward(r):
    torch.manual_seed(0)
    m = _cycle_capture(r, collect=True)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    outs, kept = [], None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        out = m(x)
        outs.append(out)
        F.cross_entropy(out, y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.data for p in m.parameters()]
        r.snap(m.net, o, outs=list(outs), kept=list(kept))
    _note(r, m)


def g_garbage_model_outputs_held_collected_later(r):
    """A's outputs kept; A dropped (cycle); B captured collects inside its forward each call."""
    torch.manual_seed(0)
    outs = []
    a = _cycle_capture(r, collect=False)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    for x, y in batches(4):
        oa.zero_grad(set_to_none=False)
        out = a(x)
        outs.append(out)
        F.cross_entropy(out, y).backward()
        oa.step()
        r.snap(None, None, outs=list(outs))
    _note(r, a)
    del a, oa
    b = _cycle_capture(r, collect=True)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for x, y in batches(4, seed=3):
        ob.zero_grad(set_to_none=False)
        out = b(x)
        F.cross_entropy(out, y).backward()
        ob.step()
        outs.append(out)
        r.snap(b.net, ob, outs=list(outs))
    _note(r, b)


def g_garbage_detached_outputs_collected_in_recording(r):
    """A's outputs kept; A dropped (cycle); B captured collects inside its forward each call."""
    torch.manual_seed(0)
    outs = []
    a = _cycle_capture(r, collect=False)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    for x, y in batches(4):
        oa.zero_grad(set_to_none=False)
        out = a(x)
        outs.append(out.detach())
        F.cross_entropy(out, y).backward()
        oa.step()
        r.snap(None, None, outs=list(outs))
    _note(r, a)
    del a, oa
    b = _cycle_capture(r, collect=True)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for x, y in batches(4, seed=3):
        ob.zero_grad(set_to_none=False)
        out = b(x)
        F.cross_entropy(out, y).backward()
        ob.step()
        outs.append(out)
        r.snap(b.net, ob, outs=list(outs))
    _note(r, b)


def g_garbage_with_grad_views(r):
    """A (held grad views) dropped; B, shared pool, collects in forward; the views of A stay read."""
    pool = r.pool()
    torch.manual_seed(0)
    kept = []

    def make(collect):
        m = GcNet(collect)
        if r.rk:
            RECS[id(m)] = weakref.ref(rk.capture(m, backend="emulated", warmup=1, pool=pool))
        return m

    a = make(False)
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(4):
        oa.zero_grad(set_to_none=False)
        F.cross_entropy(a(x), y).backward()
        oa.step()
        kept = [p.grad.view(-1) for p in a.parameters()]
        r.snap(None, None, kept=list(kept))
    _note(r, a)
    del a, oa
    b = make(True)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for x, y in batches(4, seed=3):
        ob.zero_grad(set_to_none=False)
        F.cross_entropy(b(x), y).backward()
        ob.step()
        r.snap(b.net, ob, kept=list(kept))
    _note(r, b)


# ============================================================================ more attacks
def z_warmup2_gather_once(r):
    kloop(r, "sgdm", "data", gather_once=True, cap={"warmup": 2})


def z_warmup2_view_two_shapes(r):
    kloop(r, "adamw", "view", sizes=[6, 4], cap={"warmup": 2})


def m_set_to_none_then_false_gather(r):
    """Steps 0-3 set_to_none=True (the .grad a replay hands out), then .data gathered once and
    zero_grad(set_to_none=False) from there on."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kept = None
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=i < 4)
        F.cross_entropy(model(x), y).backward()
        if i == 3:
            kept = [p.grad.data for p in params]
        o.step()
        r.snap(model, o, kept=list(kept or []))


def m_grad_data_rebind(r):
    """The loop re-binds `.grad.data` at step 4 (a fresh zero tensor); the old view stays held."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kept = []
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=False)
        if i == 4:
            for p in params:
                p.grad.data = torch.zeros_like(p)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if i in (2, 5):
            kept += [p.grad.view(-1) for p in params]
        r.snap(model, o, kept=list(kept))


def m_grad_replaced_by_clone(r):
    """`p.grad = p.grad.clone()` at step 4: the held view is no longer `.grad`'s memory."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kept = None
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=False)
        if i == 4:
            for p in params:
                p.grad = p.grad.clone()
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in params]
        r.snap(model, o, kept=list(kept))


def m_param_data_reinit_midway(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kept = None
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=False)
        if i == 4:
            with torch.no_grad():
                model[2].weight.data = torch.randn_like(model[2].weight) * 0.1
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in params]
        r.snap(model, o, kept=list(kept))


def m_deepcopy_teacher_after_capture(r):
    """`teacher = copy.deepcopy(model)` after capture (EMA teacher), used under no_grad."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    teacher, touts = None, []
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if i == 2:
            teacher = copy.deepcopy(model)
        if teacher is not None:
            with torch.no_grad():
                touts.append(teacher(x))
                for tp, p in zip(teacher.parameters(), model.parameters(), strict=False):
                    tp.mul_(0.9).add_(p, alpha=0.1)
        r.snap([model, teacher], o, touts=list(touts))


def m_post_accumulate_hook_optimizer(r):
    """Optimizer-in-backward: a per-parameter SGD stepped in a post-accumulate-grad hook, which
    keeps a view of each gradient and zeroes it in place."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in model.parameters()}
    kept = {}
    index = {p: i for i, p in enumerate(model.parameters())}

    def hook(p):
        kept[index[p]] = p.grad.view(-1).clone()
        opts[p].step()
        p.grad.zero_()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    for x, y in batches():
        F.cross_entropy(model(x), y).backward()
        r.snap(model, None, kept=[kept[k] for k in sorted(kept)])


def m_tensor_hook_scales_grad(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    model[0].weight.register_hook(lambda g: g * 0.5)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


def m_trainstep_acc2_held_views(r):
    """A TrainStep over 2 micro-batches; the loop keeps a view of `.grad` after every call."""
    torch.manual_seed(0)
    m = mlp()
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    s = r.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), o, accumulate=2)
    kept = []
    for b in batches():
        loss = s(*b)
        if m[0].weight.grad is not None:
            kept.append(m[0].weight.grad.view(-1))
        r.snap(m, o, loss=loss, kept=list(kept))


def m_input_leaf_prompt_grad(r):
    """A learnable prompt passed as an argument (not a parameter): its `.grad` view is kept."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x, prompt):
            return self.net(x + prompt)

    torch.manual_seed(0)
    model = r.wrap(Net(), warmup=1)
    prompt = torch.zeros(D, requires_grad=True)
    o = torch.optim.SGD([*model.parameters(), prompt], lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x, prompt), y).backward()
        o.step()
        if kept is None:
            kept = [prompt.grad.view(-1), model.net[0].weight.grad.data]
        r.snap(model, o, prompt=prompt, pg=prompt.grad, kept=list(kept))


def _tied(r, twice):
    """One weight used by two captured modules (tied embedding / LM head); views of it kept."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(C, D) * 0.3)

    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w
            self.b = nn.Linear(D, D)

        def forward(self, x):
            return torch.tanh(
                self.b(x) + (x @ self.w.t() @ self.w if twice else (x[:, :C] @ self.w))
            )

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, h):
            return h @ self.w.t()

    enc, head = r.wrap(Enc(), warmup=1), r.wrap(Head(), warmup=1)
    params = [w, *enc.b.parameters()]
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(head(enc(x)), y).backward()
        o.step()
        if kept is None:
            kept = [w.grad.view(-1), enc.b.weight.grad.data]
        r.snap([enc], o, kept=list(kept), wg=w.grad)


def p_two_captures_tied_weight_read_twice_documented(r):
    """limits.md 'Still silent': a weight read twice in a capture and again outside (last bits)."""
    _tied(r, True)


def p_two_captures_tied_weight_read_once(r):
    _tied(r, False)


def p_release_midway_shared_pool(r):
    """Two captures share a pool; A is released at step 4 while its gradient views are held; B
    keeps replaying in the pool A's buffers were in."""
    pool = r.pool()
    kw = {"pool": pool} if pool is not None else {}
    torch.manual_seed(0)
    a = r.wrap(mlp(), warmup=1, **kw)
    b = r.wrap(mlp(), warmup=1, **kw)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    ka = None
    for i, (x, y) in enumerate(batches()):
        if i == 4 and r.rk:
            r.entries[0].release()
        oa.zero_grad(set_to_none=False)
        ob.zero_grad(set_to_none=True)
        F.cross_entropy(a(x), y).backward()
        F.cross_entropy(b(x), y).backward()
        oa.step()
        ob.step()
        if ka is None:
            ka = [p.grad.view(-1) for p in a.parameters()]
        r.snap([a, b], oa, ka=list(ka))


def p_pool_capture_trainstep_set_to_none_history(r):
    """A capture (set_to_none=True, every step's gradient view kept) and a TrainStep in one pool."""
    pool = r.pool()
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1, **({"pool": pool} if pool is not None else {}))
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _po, s = _probe_step(r, pool)
    kept = []
    for x, y in batches():
        o.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        o.step()
        kept.append(model[0].bias.grad.view(-1))
        pl = s(x, y)
        r.snap([model, probe], o, kept=list(kept), pl=pl)


def g_release_then_new_capture_kept_views(r):
    """A's gradient views kept (given away), A released explicitly, B captured in a fresh pool
    with collection inside its forward; A's views are still read."""
    torch.manual_seed(0)
    a = r.wrap(mlp(), warmup=1)
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ka = None
    for x, y in batches(4):
        oa.zero_grad(set_to_none=False)
        F.cross_entropy(a(x), y).backward()
        oa.step()
        if ka is None:
            ka = [p.grad.data for p in a.parameters()]
        r.snap(a, oa, ka=list(ka))
    if r.rk:
        r.entries[0].release()
    b = _cycle_capture(r, collect=True)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for x, y in batches(4, seed=2):
        oa.zero_grad(set_to_none=False)
        ob.zero_grad(set_to_none=False)
        F.cross_entropy(b(x), y).backward()
        F.cross_entropy(a(x), y).backward()
        oa.step()
        ob.step()
        r.snap([a, b.net], oa, ka=list(ka))
    _note(r, b)


def m_recorder_stored_on_module(r):
    """`model.rec = rk.capture(model)` (the recorder kept on the module for its summary)."""
    torch.manual_seed(0)
    model = mlp()
    if r.rk:
        model.rec = r.wrap(model, warmup=1) and r.entries[-1]
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        o.step()
        r.snap(model, o, loss=loss)


def z_kept_outputs_and_grad_views(r):
    """Every step's output and a view of every gradient kept (both held at the give-away)."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs, kept = [], None
    for x, y in batches(sizes=[6, 6, 4]):
        o.zero_grad(set_to_none=False)
        out = model(x)
        outs.append(out)
        F.cross_entropy(out, y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, outs=list(outs), kept=list(kept))


def z_acc2_uneven_micro_batches(r):
    kloop(r, "sgdm", "view", acc=2, sizes=[5, 6], gather_once=True)


def m_partial_optimizer_accumulating(r):
    """The optimizer covers the head only; the encoder's `.grad` (views kept) grows every step."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


def m_eval_mode_training_midway(r):
    """BatchNorm frozen (model.eval()) for steps 4+ while training on: a new recording; the
    gathered-once `.data` views are read throughout."""
    torch.manual_seed(0)
    model = r.wrap(
        nn.Sequential(nn.Linear(D, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, C)), warmup=1
    )
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = None
    for i, (x, y) in enumerate(batches()):
        model.train(i < 4)
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.data for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


def m_two_optimizers_mixed_zero(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o1 = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.AdamW(model[2].parameters(), lr=1e-2)
    kept = []
    for x, y in batches():
        o1.zero_grad(set_to_none=False)
        o2.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        o1.step()
        o2.step()
        kept = [model[0].weight.grad.view(-1), model[2].weight.grad.view(-1), *kept[2:]]
        kept.append(model[2].bias.grad.data)
        r.snap(model, o1, kept=list(kept))


def m_checkpointed_block(r):
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, 16), nn.Linear(16, C)

        def forward(self, x):
            h = checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False)
            return self.b(h)

    torch.manual_seed(0)
    model = r.wrap(Net(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


def m_backward_inputs_subset(r):
    """Every other step `backward(inputs=head params)`: the encoder's held `.grad` is untouched."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = None
    for i, (x, y) in enumerate(batches()):
        o.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward(inputs=list(model[2].parameters()) if i % 2 else None)
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


def z_retain_graph_two_backwards(r):
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        out = model(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        out.pow(2).mean().backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


def m_kept_grad_reassigned_each_step(r):
    """Preallocated gradients: set_to_none each step, then `p.grad = buf; buf.zero_()` before
    the backward (the loop owns the buffers and reads them)."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    params = list(model.parameters())
    o = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    bufs = None
    for x, y in batches():
        o.zero_grad(set_to_none=True)
        if bufs is not None:
            for p, b in zip(params, bufs, strict=False):
                b.zero_()
                p.grad = b
        F.cross_entropy(model(x), y).backward()
        o.step()
        if bufs is None:
            bufs = [p.grad for p in params]
        r.snap(
            model,
            o,
            bufs=list(bufs),
            same=[p.grad is b for p, b in zip(params, bufs, strict=False)],
        )


def _shape_branch_heads(r, **cap):
    """A head used only for small batches (a shape branch): its `.grad` appears late, from a
    second signature's recording, after the first give-away."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.big, self.small = nn.Linear(D, 16), nn.Linear(16, C), nn.Linear(16, C)

        def forward(self, x):
            h = torch.relu(self.body(x))
            return self.small(h) if x.shape[0] < 5 else self.big(h)

    torch.manual_seed(0)
    model = r.wrap(Net(), warmup=1, **cap)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = []
    for x, y in batches(sizes=[6, 6, 6, 4, 6, 4, 4, 6]):
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        kept = [p.grad.view(-1) for p in model.parameters() if p.grad is not None]
        r.snap(model, o, kept=list(kept))


def m_shape_branch_heads(r):
    _shape_branch_heads(r)


def m_shape_branch_heads_rerecord_budget1(r):
    _shape_branch_heads(r, max_rerecords=1)


def z_strict_max_rerecords0(r):
    kloop(r, "sgdm", "view", cap={"max_rerecords": 0, "strict": True})


def g_pool_collected_during_recording(r):
    """A (outputs and gradient views held) is dropped; B in the same rk.MemoryPool collects in
    its forward, at its recording call; A's held tensors are read right after each call."""
    pool = r.pool()
    torch.manual_seed(0)

    def make(collect):
        m = GcNet(collect)
        m.cycle = [m]
        if r.rk:
            RECS[id(m)] = weakref.ref(rk.capture(m, backend="emulated", warmup=1, pool=pool))
        return m

    outs, kept = [], []
    a = make(False)
    oa = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches(3):
        oa.zero_grad(set_to_none=True)
        out = a(x)
        outs.append(out.detach())
        F.cross_entropy(out, y).backward()
        oa.step()
        kept.append(a.net[0].bias.grad.view(-1))
        r.snap(None, None, outs=list(outs), kept=list(kept))
    b = make(True)  # warmup=1: its first call records
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(4, seed=3)):
        if i == 0:  # garbage now: collected inside B's recording call (a capture under way)
            _note(r, a)
            del a, oa
        ob.zero_grad(set_to_none=True)
        F.cross_entropy(b(x), y).backward()
        ob.step()
        r.snap(b.net, ob, outs=list(outs), kept=list(kept))
    _note(r, b)


def g_two_recorders_collect_in_hook(r):
    """gc.collect() inside a backward hook of B while A's dropped outputs are held."""
    torch.manual_seed(0)
    outs = []
    a = _cycle_capture(r, collect=False)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    for x, y in batches(3):
        oa.zero_grad()
        out = a(x)
        outs.append(out)
        F.cross_entropy(out, y).backward()
        oa.step()
        r.snap(None, None, outs=list(outs))
    _note(r, a)
    del a, oa
    b = _cycle_capture(r, collect=False)
    b.net[0].weight.register_hook(lambda g: (gc.collect(), g)[1])
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for x, y in batches(4, seed=3):
        ob.zero_grad()
        out = b(x)
        F.cross_entropy(out, y).backward()
        ob.step()
        r.snap(b.net, ob, outs=list(outs))
    _note(r, b)


def z_output_retain_grad_kept(r):
    """`out.retain_grad()`; the loop keeps `out` and `out.grad` beside held parameter views."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs, ograds, kept = [], [], None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        out = model(x)
        out.retain_grad()
        F.cross_entropy(out, y).backward()
        o.step()
        outs.append(out)
        ograds.append(out.grad)
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, outs=list(outs), ograds=list(ograds), kept=list(kept))


def z_output_edited_in_place_kept(r):
    """The loop clamps the (linear) output in place before the loss and keeps it."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs, kept = [], None
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        out = model(x)
        out.mul_(0.5)
        outs.append(out)
        F.cross_entropy(out, y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.data for p in model.parameters()]
        r.snap(model, o, outs=list(outs), kept=list(kept))


def m_model_double_midway(r):
    """`model.double()` at step 4 (casts params and `.grad` through `.data`), inputs cast too."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = None
    for i, (x, y) in enumerate(batches()):
        if i == 4:
            model.double()
        if i >= 4:
            x = x.double()
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept), now=[p.grad for p in model.parameters()])


def m_vector_to_parameters_midway(r):
    """`parameters_to_vector` / `vector_to_parameters` (a restart from a flat copy) at step 4."""
    torch.manual_seed(0)
    model = r.wrap(mlp(), warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept, flat = None, None
    for i, (x, y) in enumerate(batches()):
        if i == 2:
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        if i == 4:
            torch.nn.utils.vector_to_parameters(flat, model.parameters())
        o.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        o.step()
        if kept is None:
            kept = [p.grad.view(-1) for p in model.parameters()]
        r.snap(model, o, kept=list(kept))


class Cfg:
    """A config/logger object with a back-reference (parent <-> child), as trainers keep."""

    def __init__(self, owner_cycle=True):
        self.lr = 0.1
        self.owner = types.SimpleNamespace(cfg=self) if owner_cycle else None
        self.items = [self]


def x_capture_cyclic_plain_attribute(r):
    torch.manual_seed(0)
    model = mlp()
    model.cfg = Cfg()
    r.wrap(model, warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches():
        o.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        o.step()
        r.snap(model, o, loss=loss)


def x_capture_cyclic_attribute_on_submodule(r):
    torch.manual_seed(0)
    model = mlp()
    model[2].meta = Cfg(owner_cycle=False)
    r.wrap(model, warmup=1)
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        o.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        o.step()
        r.snap(model, o, loss=loss, kept=[model[0].weight.grad.view(-1)])


def x_trainstep_cyclic_plain_attribute(r):
    torch.manual_seed(0)
    m = mlp()
    m.cfg = Cfg()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = r.step(m, lambda mm, x, y: F.cross_entropy(mm(x), y), o)
    for b in batches():
        r.snap(m, o, loss=s(*b))


PATTERNS = {
    k: v
    for k, v in list(globals().items())
    if k[:2] in ("c_", "z_", "m_", "p_", "g_", "x_") and callable(v)
}


def main(args):
    rows = []
    for name in select(PATTERNS, args):
        fn, res = PATTERNS[name], {}
        for col, swap in (("swap", True), ("noswap", False)):
            res[col] = run_pattern(name, fn, ROUND8, within=storage_swap(swap))
        rows.append((name, res))
        for col in ("swap", "noswap"):
            cls, n, info = res[col]
            print(f"{name:44s} | {col:6s} | {cls:17s} | {n:2d} | {info[:420]}", flush=True)
    print()
    for col in ("swap", "noswap"):
        print(col, len(rows), dict(Counter(res[col][0] for _, res in rows)))


if __name__ == "__main__":
    main(sys.argv[1:])
