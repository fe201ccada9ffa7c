"""Round 9 hostile patterns: GAN / teacher loops (a second trainable network reached by loss_fn),
packed sequences, and input-derived host reads. Run:

  OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round9/patterns.py [name-prefix ...]

The harness is scripts/hostile/harness.py (rounds 9-12 share its default profile, ROUND9).
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import Patterns, data, run_table

import replaykit as rk

PATTERNS = Patterns()
reg = PATTERNS.reg
pattern = PATTERNS.pattern
STEPS = 8


# ======================================================================================= GAN
def make_g():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 6))


class Disc(nn.Module):
    def __init__(self, kind="mlp"):
        super().__init__()
        self.kind = kind
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        if kind == "tied":
            self.fc3 = nn.Linear(8, 8)
            self.fc3.weight = self.fc2.weight
        if kind == "bn":
            self.bn = nn.BatchNorm1d(8)
        if kind == "bn_cma":
            self.bn = nn.BatchNorm1d(8, momentum=None)
        if kind == "dropout":
            self.drop = nn.Dropout(0.3)
        if kind == "weight_norm":
            nn.utils.parametrizations.weight_norm(self.fc1)
            nn.utils.parametrizations.weight_norm(self.fc2)
        if kind == "spectral_norm":
            nn.utils.parametrizations.spectral_norm(self.fc1)
            nn.utils.parametrizations.spectral_norm(self.fc2)
        if kind == "old_spectral_norm":
            nn.utils.spectral_norm(self.fc1)
        if kind == "old_weight_norm":
            nn.utils.weight_norm(self.fc2)

    def forward(self, x):
        h = F.leaky_relu(self.fc1(x), 0.2)
        if self.kind in ("bn", "bn_cma"):
            h = self.bn(h)
        h = F.leaky_relu(self.fc2(h), 0.2)
        if self.kind == "tied":
            h = torch.tanh(self.fc3(h))
        if self.kind == "dropout":
            h = self.drop(h)
        return self.out(h)


def bce(logits, target):
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def gan(
    run,
    *,
    d_kind="mlp",
    keep="none",  # "none": d_loss detached; "alive": kept (graph freed); "retain": retain_graph
    d_zero="none_start",  # none_start | none_after | false_start | between | never
    d_via="eager",  # eager | trainstep
    hook=None,  # None | grad | post_acc | module_full_backward
    midway=None,  # callable(i, ctx)
    step_kw=None,
    d_in_g_opt=False,
    toggle_rg=False,  # pix2pix: D.requires_grad_(False) around the G step
    d_eval_in_g=False,
    wgan_clip=None,  # None | inplace | rebind
    d_opt_kind="sgd",
    steps=STEPS,
    loss_form="bce",
):
    torch.manual_seed(0)
    G, D = make_g(), Disc(d_kind)
    ctx = {"G": G, "D": D}
    if hook == "grad":
        D.fc1.weight.register_hook(lambda g: g * 0.5)
    elif hook == "post_acc":
        D.out.weight.register_post_accumulate_grad_hook(lambda p: (p.grad.mul_(0.25), None)[1])
    elif hook == "module_full_backward":
        D.fc2.register_full_backward_hook(lambda m, gi, go: None)
    g_params = list(G.parameters()) + (list(D.parameters()) if d_in_g_opt else [])
    g_opt = torch.optim.SGD(g_params, lr=0.05, momentum=0.9, fused=True)
    d_opt = (
        torch.optim.Adam(D.parameters(), lr=1e-3)
        if d_opt_kind == "adam"
        else torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    )
    ctx["d_opt"] = d_opt

    def g_loss(g, z):
        out = ctx["D"](g(z))
        return bce(out, 1.0) if loss_form == "bce" else -out.mean()

    gstep = run.step(G, g_loss, g_opt, **(step_kw or {}))

    def d_loss_fn(d, z, real):
        fake = G(z).detach()
        return bce(d(real), 1.0) + bce(d(fake), 0.0)

    dstep = run.step(D, d_loss_fn, d_opt) if d_via == "trainstep" else None
    kept_alive = []
    for i in range(steps):
        if midway is not None:
            midway(i, ctx)
        D = ctx["D"]
        d_opt = ctx["d_opt"]
        z, real, z2 = data(100 + i, (5, 4), (5, 6), (5, 4))
        real = real + 1.0
        if not any(p.requires_grad for p in D.parameters()):
            with torch.no_grad():
                d_loss = d_loss_fn(D, z, real)
        elif dstep is not None:
            d_loss = dstep(z, real)
        else:
            if d_zero in ("none_start", "none_after"):
                d_opt.zero_grad(set_to_none=True)
            elif d_zero == "false_start":
                d_opt.zero_grad(set_to_none=False)
            d_loss = d_loss_fn(D, z, real)
            if keep == "retain":
                d_loss.backward(retain_graph=True)
            else:
                d_loss.backward()
            d_opt.step()
            if wgan_clip == "inplace":
                for p in D.parameters():
                    p.data.clamp_(-0.05, 0.05)
            elif wgan_clip == "rebind":
                for p in D.parameters():
                    p.data = p.data.clamp(-0.05, 0.05)
            if d_zero == "none_after":
                d_opt.zero_grad(set_to_none=True)
            elif d_zero == "between":
                D.zero_grad(set_to_none=False)
        if keep in ("alive", "retain"):
            kept_alive.append(d_loss)
        if toggle_rg:
            D.requires_grad_(False)
        if d_eval_in_g:
            D.eval()
        g_l = gstep(z2)
        if d_eval_in_g:
            D.train()
        if toggle_rg:
            D.requires_grad_(True)
        run.snap([G, ctx["D"]], [g_opt, ctx["d_opt"]], g_loss=g_l, d_loss=d_loss.detach())


reg("gan_basic_detached", gan)
reg("gan_d_loss_alive", gan, keep="alive")
reg("gan_d_loss_retain_graph", gan, keep="retain")
reg("gan_d_grads_none_before_g", gan, keep="alive", d_zero="none_after")
reg("gan_d_grads_accumulated_false_start", gan, keep="alive", d_zero="false_start")
reg("gan_d_never_zeroed", gan, keep="alive", d_zero="never")
reg("gan_d_zero_grad_between", gan, keep="alive", d_zero="between")
reg("gan_tied_d", gan, d_kind="tied", keep="alive")
reg("gan_tied_d_none_after", gan, d_kind="tied", keep="alive", d_zero="none_after")
reg("gan_weight_norm_d", gan, d_kind="weight_norm", keep="alive")
reg("gan_spectral_norm_d", gan, d_kind="spectral_norm", keep="alive")
reg("gan_spectral_norm_d_detached", gan, d_kind="spectral_norm")
reg("gan_old_spectral_norm_d", gan, d_kind="old_spectral_norm", keep="alive")
reg("gan_old_weight_norm_d", gan, d_kind="old_weight_norm", keep="alive")
reg("gan_d_tensor_hook", gan, keep="alive", hook="grad")
reg("gan_d_post_accumulate_hook", gan, keep="alive", hook="post_acc")
reg("gan_d_module_backward_hook", gan, keep="alive", hook="module_full_backward")
reg("gan_d_params_in_g_opt", gan, keep="alive", d_in_g_opt=True)
reg("gan_pix2pix_toggle_requires_grad", gan, keep="alive", toggle_rg=True)
reg("gan_d_eval_in_g_step", gan, d_kind="dropout", keep="alive", d_eval_in_g=True)
reg("gan_d_dropout_train", gan, d_kind="dropout", keep="alive")
reg("gan_d_batchnorm", gan, d_kind="bn", keep="alive")
reg("gan_d_batchnorm_cumulative", gan, d_kind="bn_cma", keep="alive")
reg("gan_amp_bf16", gan, keep="alive", step_kw={"precision": "bf16-mixed"})
reg("gan_accumulate2", gan, keep="alive", step_kw={"accumulate": 2})
reg(
    "gan_amp_bf16_acc2_adam_d",
    gan,
    keep="alive",
    d_opt_kind="adam",
    step_kw={"precision": "bf16-mixed", "accumulate": 2},
)
reg("gan_d_via_trainstep", gan, d_via="trainstep")
reg("gan_wgan_clip_inplace", gan, keep="alive", wgan_clip="inplace", loss_form="wgan")
reg("gan_wgan_clip_data_rebind", gan, keep="alive", wgan_clip="rebind", loss_form="wgan")
reg("gan_max_norm_clip", gan, keep="alive", step_kw={"max_norm": 0.5})


def _replace_head(i, ctx, tell_opt):
    if i == 4:
        torch.manual_seed(7)
        ctx["D"].out = nn.Linear(8, 1)
        if tell_opt:
            ctx["d_opt"] = torch.optim.SGD(ctx["D"].parameters(), lr=0.05, momentum=0.9)


def _freeze(i, ctx):
    if i == 4:
        ctx["D"].requires_grad_(False)


def _unfreeze(i, ctx):
    if i == 0:
        ctx["D"].requires_grad_(False)
    if i == 4:
        ctx["D"].requires_grad_(True)


def _reassign_weight(i, ctx):
    if i == 4:
        D = ctx["D"]
        D.out.weight = nn.Parameter(D.out.weight.detach() * 0.5)
        ctx["d_opt"] = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)


def _load_assign(i, ctx):
    if i == 4:
        D = ctx["D"]
        sd = {k: v.clone() * 0.9 for k, v in D.state_dict().items()}
        D.load_state_dict(sd, assign=True)
        ctx["d_opt"] = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)


def _load_copy(i, ctx):
    if i == 4:
        D = ctx["D"]
        D.load_state_dict({k: v.clone() * 0.9 for k, v in D.state_dict().items()})


def _vec_to_params(i, ctx):
    if i in (3, 5):
        D = ctx["D"]
        v = nn.utils.parameters_to_vector(D.parameters()).detach() * 0.95
        nn.utils.vector_to_parameters(v, D.parameters())


def _data_rebind_once(i, ctx):
    if i == 4:
        D = ctx["D"]
        D.out.weight.data = D.out.weight.data.clone() * 0.5


def _swap_d(i, ctx):  # a new discriminator object (restart D)
    if i == 4:
        torch.manual_seed(9)
        ctx["D"] = Disc()
        ctx["d_opt"] = torch.optim.SGD(ctx["D"].parameters(), lr=0.05, momentum=0.9)


def _double_d(i, ctx):
    if i == 4:
        ctx["D"].to(torch.float64).to(torch.float32)


reg(
    "gan_d_head_replaced_opt_told",
    gan,
    keep="alive",
    midway=functools.partial(_replace_head, tell_opt=True),
)
reg(
    "gan_d_head_replaced_opt_not_told",
    gan,
    keep="alive",
    midway=functools.partial(_replace_head, tell_opt=False),
)
reg("gan_d_head_replaced_detached", gan, midway=functools.partial(_replace_head, tell_opt=True))
reg("gan_d_frozen_midway", gan, keep="alive", midway=_freeze)
reg("gan_d_unfrozen_midway", gan, keep="alive", midway=_unfreeze)
reg("gan_d_weight_reassigned_midway", gan, keep="alive", midway=_reassign_weight)
reg("gan_d_load_state_dict_assign", gan, keep="alive", midway=_load_assign)
reg("gan_d_load_state_dict_copy", gan, keep="alive", midway=_load_copy)
reg("gan_d_vector_to_parameters", gan, keep="alive", midway=_vec_to_params)
reg("gan_d_param_data_rebind_once", gan, keep="alive", midway=_data_rebind_once)
reg("gan_d_object_swapped", gan, keep="alive", midway=_swap_d)
reg("gan_d_to_double_and_back", gan, keep="alive", midway=_double_d)


@pattern("gan_d_shared_by_two_trainsteps")
def gan_two_g(run):
    torch.manual_seed(0)
    G1, G2, D = make_g(), make_g(), Disc()
    o1 = torch.optim.SGD(G1.parameters(), lr=0.05, momentum=0.9, fused=True)
    o2 = torch.optim.SGD(G2.parameters(), lr=0.05, momentum=0.9, fused=True)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    s1 = run.step(G1, lambda g, z: bce(D(g(z)), 1.0), o1)
    s2 = run.step(G2, lambda g, z: bce(D(g(z)), 1.0), o2)
    for i in range(STEPS):
        z, real, z2, z3 = data(200 + i, (5, 4), (5, 6), (5, 4), (5, 4))
        d_opt.zero_grad(set_to_none=True)
        d_loss = bce(D(real), 1.0) + bce(D(G1(z).detach()), 0.0) + bce(D(G2(z).detach()), 0.0)
        d_loss.backward()
        d_opt.step()
        l1 = s1(z2)
        l2 = s2(z3)
        run.snap([G1, G2, D], [o1, o2, d_opt], l1=l1, l2=l2, d=d_loss.detach())


@pattern("gan_cyclegan_two_g_two_d_in_one_step")
def cyclegan(run):
    torch.manual_seed(0)
    Gs = nn.ModuleDict({"ab": nn.Linear(6, 6), "ba": nn.Linear(6, 6)})
    Da, Db = Disc(), Disc()
    g_opt = torch.optim.AdamW(Gs.parameters(), lr=1e-3, fused=True, capturable=True)
    d_opt = torch.optim.Adam([*Da.parameters(), *Db.parameters()], lr=1e-3)

    def g_loss(g, a, b):
        fb, fa = g["ab"](a), g["ba"](b)
        cyc = F.l1_loss(g["ba"](fb), a) + F.l1_loss(g["ab"](fa), b)
        return bce(Db(fb), 1.0) + bce(Da(fa), 1.0) + 10 * cyc

    step = run.step(Gs, g_loss, g_opt)
    for i in range(STEPS):
        a, b = data(300 + i, (5, 6), (5, 6))
        Da.requires_grad_(False)
        Db.requires_grad_(False)
        gl = step(a, b)
        Da.requires_grad_(True)
        Db.requires_grad_(True)
        d_opt.zero_grad()
        with torch.no_grad():
            fb, fa = Gs["ab"](a), Gs["ba"](b)
        dl = bce(Da(a), 1.0) + bce(Da(fa), 0.0) + bce(Db(b), 1.0) + bce(Db(fb), 0.0)
        dl.backward()
        d_opt.step()
        run.snap([Gs, Da, Db], [g_opt, d_opt], gl=gl, dl=dl.detach())


@pattern("gan_wgan_gp_d_trainstep")
def wgan_gp(run):
    torch.manual_seed(0)
    G, D = make_g(), Disc()
    g_opt = torch.optim.SGD(G.parameters(), lr=0.01, fused=True)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.01, fused=True)

    def d_loss(d, z, real):
        fake = G(z).detach()
        eps = torch.rand(real.shape[0], 1)
        x = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(d(x).sum(), x, create_graph=True)
        gp = ((grad.norm(2, dim=1) - 1) ** 2).mean()
        return d(fake).mean() - d(real).mean() + 10 * gp

    dstep = run.step(D, d_loss, d_opt)
    gstep = run.step(G, lambda g, z: -D(g(z)).mean(), g_opt)
    for i in range(STEPS):
        z, real, z2 = data(400 + i, (5, 4), (5, 6), (5, 4))
        dl = dstep(z, real)
        gl = gstep(z2)
        run.snap([G, D], [g_opt, d_opt], gl=gl, dl=dl)


@pattern("gan_wgan_gp_in_g_loss_capture_d_eager")
def wgan_gp_capture(run):
    # G captured; D step eager with gradient penalty through D only (G output detached)
    torch.manual_seed(0)
    G, D = make_g(), Disc()
    run.wrap(G)
    g_opt = torch.optim.SGD(G.parameters(), lr=0.01)
    d_opt = torch.optim.Adam(D.parameters(), lr=1e-3)
    for i in range(STEPS):
        z, real, z2 = data(450 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad()
        fake = G(z).detach()
        eps = torch.rand(5, 1)
        x = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(D(x).sum(), x, create_graph=True)
        dl = D(fake).mean() - D(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
        dl.backward()
        d_opt.step()
        g_opt.zero_grad()
        gl = -D(G(z2)).mean()
        gl.backward()
        g_opt.step()
        run.snap([G, D], [g_opt, d_opt], gl=gl.detach(), dl=dl.detach())


@pattern("gan_capture_g_plain_loop_d_alive")
def gan_capture(run):
    torch.manual_seed(0)
    G, D = make_g(), Disc("bn")
    run.wrap(G)
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    kept = []
    for i in range(STEPS):
        z, real = data(500 + i, (5, 4), (5, 6))
        d_opt.zero_grad()
        fake = G(z)
        dl = bce(D(real), 1.0) + bce(D(fake.detach()), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        g_opt.zero_grad()
        gl = bce(D(fake), 1.0)  # reuses this step's fake (its graph through G pending)
        gl.backward()
        g_opt.step()
        run.snap([G, D], [g_opt, d_opt], gl=gl.detach(), dl=dl.detach(), fake=fake.detach())


@pattern("distill_teacher_trained_by_own_opt")
def distill_online(run):
    torch.manual_seed(0)
    S = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    T = nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Linear(24, 3))
    s_opt = torch.optim.AdamW(S.parameters(), lr=1e-3, fused=True, capturable=True)
    t_opt = torch.optim.SGD(T.parameters(), lr=0.05)

    def loss_fn(s, x, y):
        ls, lt = s(x), T(x)  # teacher logits not detached: its grads accumulate too
        return F.cross_entropy(ls, y) + F.kl_div(
            F.log_softmax(ls, -1), F.softmax(lt, -1), reduction="batchmean"
        )

    step = run.step(S, loss_fn, s_opt)
    kept = []
    for i in range(STEPS):
        (x,) = data(600 + i, (5, 6))
        y = torch.arange(5) % 3
        sl = step(x, y)
        tl = F.cross_entropy(T(x), y)
        tl.backward()  # onto the grads the student step left on T
        t_opt.step()
        if i % 2 == 1:
            t_opt.zero_grad()
        kept.append(tl)
        run.snap([S, T], [s_opt, t_opt], sl=sl, tl=tl.detach())


@pattern("distill_mutual_learning_two_trainsteps")
def distill_mutual(run):
    torch.manual_seed(0)
    A = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    B = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 3))
    oa = torch.optim.SGD(A.parameters(), lr=0.05, momentum=0.9, fused=True)
    ob = torch.optim.SGD(B.parameters(), lr=0.05, momentum=0.9, fused=True)

    def la(a, x, y):
        return F.cross_entropy(a(x), y) + F.mse_loss(a(x), B(x))  # B not detached

    def lb(b, x, y):
        return F.cross_entropy(b(x), y) + F.mse_loss(b(x), A(x))

    sa, sb = run.step(A, la, oa), run.step(B, lb, ob)
    for i in range(STEPS):
        (x,) = data(650 + i, (5, 6))
        y = torch.arange(5) % 3
        l1 = sa(x, y)
        l2 = sb(x, y)
        run.snap([A, B], [oa, ob], l1=l1, l2=l2)


@pattern("distill_frozen_teacher_eval")
def distill_frozen(run):
    torch.manual_seed(0)
    S = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    T = (
        nn.Sequential(nn.Linear(6, 24), nn.Dropout(0.2), nn.Linear(24, 3))
        .eval()
        .requires_grad_(False)
    )
    s_opt = torch.optim.SGD(S.parameters(), lr=0.05, momentum=0.9, fused=True)

    def loss_fn(s, x, y):
        return F.cross_entropy(s(x), y) + F.mse_loss(s(x), T(x))

    step = run.step(S, loss_fn, s_opt)
    for i in range(STEPS):
        (x,) = data(700 + i, (5, 6))
        sl = step(x, torch.arange(5) % 3)
        run.snap([S, T], [s_opt], sl=sl)


@pattern("gan_ema_of_d_requires_grad")
def gan_ema_d(run):
    torch.manual_seed(0)
    G, D = make_g(), Disc()
    D_ema = copy.deepcopy(D)  # requires_grad stays True: its .grad accumulates in the G step
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9, fused=True)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    step = run.step(G, lambda g, z: bce(D_ema(g(z)), 1.0) + bce(D(g(z)), 1.0), g_opt)
    kept = []
    for i in range(STEPS):
        z, real, z2 = data(800 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad(set_to_none=True)
        dl = bce(D(real), 1.0) + bce(D(G(z).detach()), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        with torch.no_grad():
            for pe, p in zip(D_ema.parameters(), D.parameters(), strict=False):
                pe.mul_(0.9).add_(p, alpha=0.1)
        gl = step(z2)
        run.snap([G, D, D_ema], [g_opt, d_opt], gl=gl, dl=dl.detach())


@pattern("gan_rk_ema_of_g_with_d")
def gan_rk_ema(run):
    torch.manual_seed(0)
    G, D = make_g(), Disc()
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9, fused=True)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    ema = rk.EMA(G, decay=0.9)
    step = run.step(G, lambda g, z: bce(D(g(z)), 1.0), g_opt, ema=ema)
    kept = []
    for i in range(STEPS):
        z, real, z2 = data(850 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad()
        dl = bce(D(real), 1.0) + bce(D(G(z).detach()), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        gl = step(z2)
        run.snap(
            [G, D],
            [g_opt, d_opt],
            gl=gl,
            ema=[t for t in ema.state_dict().values() if isinstance(t, torch.Tensor)]
            if hasattr(ema, "state_dict")
            else None,
        )


# ============================================================================ packed sequences
class PackedRNN(nn.Module):
    def __init__(
        self, cell="lstm", bidir=False, sorted_=False, use="h", layers=1, emb=False, total=None
    ):
        super().__init__()
        self.emb = nn.Embedding(20, 6, padding_idx=0) if emb else None
        kinds = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}
        self.rnn = kinds[cell](6, 8, num_layers=layers, batch_first=True, bidirectional=bidir)
        self.head = nn.Linear(8 * (2 if bidir else 1), 3)
        self.sorted_, self.use, self.cell, self.total, self.bidir = sorted_, use, cell, total, bidir

    def forward(self, x, lengths):
        if self.emb is not None:
            x = self.emb(x)
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.sorted_)
        out, h = self.rnn(packed)
        if self.use == "h":
            h = h[0] if self.cell == "lstm" else h
            feat = torch.cat([h[-2], h[-1]], -1) if self.bidir else h[-1]
            return self.head(feat)
        padded, lens = pad_packed_sequence(out, batch_first=True, total_length=self.total)
        mask = (torch.arange(padded.shape[1])[None, :] < lens[:, None]).to(padded.dtype)
        pooled = (padded * mask[..., None]).sum(1) / lens[:, None].to(padded.dtype)
        return self.head(pooled)


def _lengths(mode, i, B=4, T=7):
    g = torch.Generator().manual_seed(900 + i)
    if mode == "fixed":
        L = torch.tensor([5, 7, 2, 4])
    elif mode == "cycle":
        L = [torch.tensor([5, 7, 2, 4]), torch.tensor([7, 3, 3, 1]), torch.tensor([6, 6, 6, 6])][
            i % 3
        ]
    elif mode == "random":
        L = torch.randint(1, T + 1, (B,), generator=g)
    elif mode == "sorted_cycle":
        L = [torch.tensor([7, 5, 4, 2]), torch.tensor([6, 3, 3, 1])][i % 2]
    elif mode == "cycle2":
        L = [torch.tensor([5, 7, 2, 4]), torch.tensor([4, 2, 7, 5])][i % 2]  # same multiset
    return L


def packed(run, *, api="capture", lmode="cycle", as_list=False, steps=STEPS, T=7, **mk):
    torch.manual_seed(0)
    m = PackedRNN(**mk)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)

    def loss_fn(mod, x, L, y):
        return F.cross_entropy(mod(x, L), y)

    if api == "capture":
        run.wrap(m)
        step = None
    else:
        step = run.step(m, loss_fn, opt)
    for i in range(steps):
        L = _lengths(lmode, i, T=T)
        Tcur = T
        if mk.get("emb"):
            g = torch.Generator().manual_seed(950 + i)
            x = torch.randint(1, 20, (4, Tcur), generator=g)
            x = x * (torch.arange(Tcur)[None] < L[:, None])
        else:
            (x,) = data(950 + i, (4, Tcur, 6))
        y = torch.tensor([0, 1, 2, 1])
        Larg = L.tolist() if as_list else L
        if step is None:
            out = m(x, Larg)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.snap([m], [opt], loss=loss.detach(), out=out.detach())
        else:
            loss = step(x, Larg, y)
            run.snap([m], [opt], loss=loss)


reg("packed_lstm_unsorted_cycle_capture", packed)
reg("packed_lstm_unsorted_cycle_trainstep", packed, api="step")
reg("packed_lstm_unsorted_fixed_capture", packed, lmode="fixed")
reg("packed_lstm_unsorted_random_capture", packed, lmode="random", steps=12)
reg("packed_lstm_unsorted_random_trainstep", packed, api="step", lmode="random", steps=12)
reg("packed_lstm_same_multiset_perm_capture", packed, lmode="cycle2")
reg("packed_lstm_same_multiset_perm_trainstep", packed, api="step", lmode="cycle2")
reg("packed_lstm_lengths_list_capture", packed, as_list=True)
reg("packed_lstm_lengths_list_trainstep", packed, api="step", as_list=True)
reg("packed_lstm_sorted_capture", packed, lmode="sorted_cycle", sorted_=True)
reg(
    "packed_gru_sorted_trainstep",
    packed,
    api="step",
    lmode="sorted_cycle",
    sorted_=True,
    cell="gru",
)
reg("packed_gru_unsorted_pad_lengths_capture", packed, cell="gru", use="pad")
reg("packed_gru_unsorted_pad_lengths_trainstep", packed, api="step", cell="gru", use="pad")
reg(
    "packed_gru_pad_total_length_perm_capture",
    packed,
    cell="gru",
    use="pad",
    total=7,
    lmode="cycle2",
)
reg("packed_rnn_bidir_capture", packed, cell="rnn", bidir=True)
reg("packed_lstm_bidir_2layer_pad_trainstep", packed, api="step", bidir=True, layers=2, use="pad")
reg("packed_lstm_embedding_capture", packed, emb=True, use="pad")
reg(
    "packed_gru_bidir_pad_perm_trainstep",
    packed,
    api="step",
    cell="gru",
    bidir=True,
    use="pad",
    lmode="cycle2",
)


class MaskToPacked(nn.Module):
    """The collate gives padded token ids; lengths come from the mask inside forward."""

    def __init__(self, word_dropout=False):
        super().__init__()
        self.emb = nn.Embedding(20, 6, padding_idx=0)
        self.rnn = nn.GRU(6, 8, batch_first=True)
        self.head = nn.Linear(8, 3)
        self.word_dropout = word_dropout

    def forward(self, ids):
        lengths = (ids != 0).sum(1)
        if self.word_dropout and self.training:
            # random truncation: each sequence keeps a random prefix of at least 1 token
            cut = torch.empty_like(lengths).random_(1, 8)
            lengths = torch.minimum(lengths, cut)
        packed = pack_padded_sequence(
            self.emb(ids), lengths, batch_first=True, enforce_sorted=False
        )
        _, h = self.rnn(packed)
        return self.head(h[-1])


def mask_packed(run, *, api="capture", word_dropout=False, vary=True):
    torch.manual_seed(0)
    m = MaskToPacked(word_dropout)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, fused=True)
    if api == "capture":
        run.wrap(m)
    else:
        step = run.step(m, lambda mod, ids, y: F.cross_entropy(mod(ids), y), opt)
    torch.manual_seed(5)
    for i in range(STEPS):
        L = _lengths("cycle" if vary else "fixed", i)
        g = torch.Generator().manual_seed(990 + i)
        ids = torch.randint(1, 20, (4, 7), generator=g) * (torch.arange(7)[None] < L[:, None])
        y = torch.tensor([0, 1, 2, 1])
        if api == "capture":
            out = m(ids)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.snap([m], [opt], loss=loss.detach(), rng=torch.get_rng_state())
        else:
            loss = step(ids, y)
            run.snap([m], [opt], loss=loss, rng=torch.get_rng_state())


reg("packed_lengths_from_mask_capture", mask_packed)
reg("packed_lengths_from_mask_trainstep", mask_packed, api="step")
reg(
    "packed_random_truncation_empty_like_random_capture", mask_packed, word_dropout=True, vary=False
)
reg(
    "packed_random_truncation_empty_like_random_trainstep",
    mask_packed,
    api="step",
    word_dropout=True,
    vary=False,
)


# ================================================================= input-derived host reads
class HostReads(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.enc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, idx):
        h = torch.tanh(self.enc(x))  # x: (B, 6), idx: (B,) int64 from the batch
        k = self.kind
        if k == "argmax_int":
            j = int(idx.argmax())
            h = h + h[j : j + 1]
        elif k == "max_slice":
            T = int(idx.max())
            h = h[:, :T].sum(1, keepdim=True) * h
        elif k == "invert_perm":
            perm = torch.argsort(idx, stable=True)
            inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel()))
            hs = torch.cumsum(h[perm], 0)
            h = hs[inv]
        elif k == "invert_perm_host_read":
            perm = torch.argsort(idx, stable=True)
            inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel()))
            first = int(inv[0])
            h = h * (first + 1)
        elif k == "invert_perm_tolist":
            perm = torch.argsort(idx, stable=True)
            inv = torch.empty_like(perm)
            inv.scatter_(0, perm, torch.arange(perm.numel()))
            order = inv.tolist()
            h = torch.stack([h[o] for o in order])
        elif k == "zeros_like_scatter_read":
            perm = torch.argsort(idx, stable=True)
            inv = torch.zeros_like(perm).scatter_(0, perm, torch.arange(perm.numel()))
            h = h * (int(inv[0]) + 1)
        elif k == "empty_like_index_put_read":
            perm = torch.argsort(idx, stable=True)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel())
            h = h * (int(inv[0]) + 1)
        elif k == "empty_like_fill_then_add":
            c = torch.empty_like(idx).fill_(2)
            c.add_(idx)  # second in-place write after the fill
            h = h * float(int(c.sum()))
        elif k == "tolist_split":
            sizes = idx.tolist()  # idx: sizes summing to B
            h = torch.cat([c.mean(0, keepdim=True).expand_as(c) for c in torch.split(h, sizes)])
        elif k == "bool_mask":
            sel = h[idx > 0]
            h = h + sel.sum(0, keepdim=True)
        elif k == "bincount":
            w = torch.bincount(idx, minlength=3).float()
            h = h * w[:3].sum()
        elif k == "one_hot":
            h = h + F.one_hot(idx, 8).float()
        elif k == "one_hot_infer":
            oh = F.one_hot(idx).float()
            h = h[:, : oh.shape[1]].sum(1, keepdim=True) * h
        elif k == "repeat_interleave":
            r = torch.repeat_interleave(h, idx.clamp(min=1), dim=0)
            h = h + r.mean(0, keepdim=True)
        elif k == "unique":
            u = torch.unique(idx)
            h = h * u.numel()
        elif k == "any_branch":
            if (idx == 0).any():
                h = h * 2
        elif k == "randperm_like":
            # a fresh empty tensor filled by a random draw, then read on the host
            r = torch.empty_like(idx).random_(0, 3)
            h = h * (int(r.sum()) + 1)
        elif k == "bernoulli_like":
            keep = torch.empty_like(idx, dtype=torch.float32).bernoulli_(0.5)
            h = h * (int(keep.sum()) + 1)
        elif k == "scatter_add_counts":
            cnt = torch.zeros(4, dtype=torch.long).scatter_add_(
                0, idx.clamp(0, 3), torch.ones_like(idx)
            )
            h = h * (int(cnt.argmax()) + 1)
        elif k == "index_select_sorted":
            s, order = torch.sort(idx)
            h = h.index_select(0, order) + s[:, None].float()
        return self.head(h)


def host_reads(run, *, kind, api="capture", idx_mode="cycle", steps=STEPS):
    torch.manual_seed(0)
    m = HostReads(kind)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True)
    if api == "capture":
        run.wrap(m)
    else:
        step = run.step(m, lambda mod, x, idx, y: F.cross_entropy(mod(x, idx), y), opt)
    torch.manual_seed(3)
    for i in range(steps):
        (x,) = data(1000 + i, (4, 6))
        if idx_mode == "sizes":
            idx = [
                torch.tensor([1, 3, 0, 0]),
                torch.tensor([2, 2, 0, 0]),
                torch.tensor([4, 0, 0, 0]),
            ][i % 3]
        elif idx_mode == "cycle":
            idx = [
                torch.tensor([3, 1, 2, 0]),
                torch.tensor([0, 2, 1, 3]),
                torch.tensor([2, 2, 5, 1]),
            ][i % 3]
        elif idx_mode == "random":
            idx = torch.randint(0, 6, (4,), generator=torch.Generator().manual_seed(1100 + i))
        y = torch.tensor([0, 1, 2, 1])
        if api == "capture":
            out = m(x, idx)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.snap([m], [opt], loss=loss.detach(), out=out.detach(), rng=torch.get_rng_state())
        else:
            loss = step(x, idx, y)
            run.snap([m], [opt], loss=loss, rng=torch.get_rng_state())


for _k in [
    "argmax_int",
    "max_slice",
    "invert_perm",
    "invert_perm_host_read",
    "invert_perm_tolist",
    "zeros_like_scatter_read",
    "empty_like_index_put_read",
    "empty_like_fill_then_add",
    "bool_mask",
    "bincount",
    "one_hot",
    "one_hot_infer",
    "repeat_interleave",
    "unique",
    "any_branch",
    "randperm_like",
    "bernoulli_like",
    "scatter_add_counts",
    "index_select_sorted",
]:
    reg(f"read_{_k}_capture", host_reads, kind=_k)
    reg(f"read_{_k}_trainstep", host_reads, kind=_k, api="step")
reg("read_tolist_split_capture", host_reads, kind="tolist_split", idx_mode="sizes")
reg("read_tolist_split_trainstep", host_reads, kind="tolist_split", api="step", idx_mode="sizes")
reg(
    "read_invert_perm_random_trainstep",
    host_reads,
    kind="invert_perm_host_read",
    api="step",
    idx_mode="random",
    steps=14,
)
reg("read_argmax_random_capture", host_reads, kind="argmax_int", idx_mode="random", steps=14)


@pattern("read_collate_in_loss_fn_trainstep")
def collate_loss(run):
    """Collate-like work in loss_fn: sort by length, gather, class weights from bincount."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.05, fused=True)

    def loss_fn(mod, x, y, lengths):
        order = torch.argsort(lengths, descending=True)
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
        logits = mod(x[order])[inv]
        w = 1.0 / (torch.bincount(y, minlength=3).float() + 1.0)
        return F.cross_entropy(logits, y, weight=w)

    step = run.step(m, loss_fn, opt)
    for i in range(STEPS):
        (x,) = data(1200 + i, (4, 6))
        y = [torch.tensor([0, 1, 2, 1]), torch.tensor([2, 2, 0, 1])][i % 2]
        L = _lengths("cycle", i)
        loss = step(x, y, L)
        run.snap([m], [opt], loss=loss)


@pattern("gan_two_ds_share_a_parameter")
def gan_shared_param(run):
    """Multi-scale critics sharing their first layer's weight (one Parameter in two modules)."""
    torch.manual_seed(0)
    G, D1, D2 = make_g(), Disc(), Disc()
    D2.fc1.weight = D1.fc1.weight
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9, fused=True)
    dps = list({id(p): p for p in [*D1.parameters(), *D2.parameters()]}.values())
    d_opt = torch.optim.SGD(dps, lr=0.05, momentum=0.9)
    step = run.step(G, lambda g, z: bce(D1(g(z)), 1.0) + bce(D2(g(z) * 0.5), 1.0), g_opt)
    kept = []
    for i in range(STEPS):
        z, real, z2 = data(1300 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad(set_to_none=False)
        fake = G(z).detach()
        dl = bce(D1(real), 1.0) + bce(D1(fake), 0.0) + bce(D2(real), 1.0) + bce(D2(fake), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        gl = step(z2)
        run.snap([G, D1, D2], [g_opt, d_opt], gl=gl, dl=dl.detach())


@pattern("gan_d_grad_refs_kept_for_logging")
def gan_kept_grad_refs(run):
    torch.manual_seed(0)
    G, D = make_g(), Disc()
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9, fused=True)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    step = run.step(G, lambda g, z: bce(D(g(z)), 1.0), g_opt)
    refs, kept = None, []
    for i in range(STEPS):
        z, real, z2 = data(1400 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad(set_to_none=False)
        dl = bce(D(real), 1.0) + bce(D(G(z).detach()), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        gl = step(z2)
        if refs is None:
            refs = [p.grad for p in D.parameters()]  # a logger keeps the grad tensors
        run.snap(
            [G, D],
            [g_opt, d_opt],
            gl=gl,
            refs=refs,
            same_obj=[r is p.grad for r, p in zip(refs, D.parameters(), strict=False)],
        )


@pattern("gan_d_registered_in_g_not_in_opt")
def gan_d_inside_g(run):
    """The generator module holds the critic as a submodule (a wrapper), the optimizer only G's."""
    torch.manual_seed(0)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.d = make_g(), Disc()

        def forward(self, z):
            return self.d(self.g(z))

    W = Wrap()
    g_opt = torch.optim.SGD(W.g.parameters(), lr=0.05, momentum=0.9, fused=True)
    d_opt = torch.optim.SGD(W.d.parameters(), lr=0.05, momentum=0.9)
    step = run.step(W, lambda w, z: bce(w(z), 1.0), g_opt)
    kept = []
    for i in range(STEPS):
        z, real, z2 = data(1500 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad()
        dl = bce(W.d(real), 1.0) + bce(W.d(W.g(z).detach()), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        gl = step(z2)
        run.snap([W], [g_opt, d_opt], gl=gl, dl=dl.detach())


@pattern("gan_d_param_with_python_attribute")
def gan_param_attr(run):
    """The critic's forward reads a Python attribute set on its weight (an lr multiplier)."""
    torch.manual_seed(0)

    class EqLinear(nn.Linear):
        def forward(self, x):
            return F.linear(x, self.weight * self.weight.gain, self.bias)

    G = make_g()
    D = nn.Sequential(EqLinear(6, 8), nn.LeakyReLU(0.2), EqLinear(8, 1))
    for mod in D:
        if isinstance(mod, EqLinear):
            mod.weight.gain = 0.5
    g_opt = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9, fused=True)
    d_opt = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    step = run.step(G, lambda g, z: bce(D(g(z)), 1.0), g_opt)
    kept = []
    for i in range(STEPS):
        z, real, z2 = data(1600 + i, (5, 4), (5, 6), (5, 4))
        d_opt.zero_grad()
        dl = bce(D(real), 1.0) + bce(D(G(z).detach()), 0.0)
        dl.backward()
        d_opt.step()
        kept.append(dl)
        gl = step(z2)
        run.snap([G, D], [g_opt, d_opt], gl=gl, dl=dl.detach())


@pattern("packed_gru_pad_lengths_capture_fixed")
def packed_fixed_pad(run):
    packed(run, cell="gru", use="pad", lmode="fixed")


@pattern("packed_gru_pad_lengths_trainstep_fixed")
def packed_fixed_pad_step(run):
    packed(run, api="step", cell="gru", use="pad", lmode="fixed")


CFG = {"k": 2}


class GlobalFill(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.how = how

    def forward(self, x, idx):
        if self.how == "empty_fill":
            c = torch.empty_like(idx).fill_(CFG["k"])
        elif self.how == "full_like":
            c = torch.full_like(idx, CFG["k"])
        elif self.how == "empty_copy_flip":
            c = torch.empty_like(idx).copy_(idx.flip(0))
        return self.fc(x) * int(c[0])


def global_fill(run, *, how, api="capture"):
    torch.manual_seed(0)
    CFG["k"] = 2
    m = GlobalFill(how)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    if api == "capture":
        run.wrap(m)
    else:
        step = run.step(m, lambda mod, x, idx, y: F.cross_entropy(mod(x, idx), y), opt)
    for i in range(STEPS):
        if i == 4:
            CFG["k"] = 3  # a curriculum setting changed midway
        (x,) = data(1700 + i, (4, 6))
        idx, y = torch.tensor([1, 2, 3, 0]), torch.tensor([0, 1, 2, 1])
        if api == "capture":
            loss = F.cross_entropy(m(x, idx), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.snap([m], [opt], loss=loss.detach())
        else:
            run.snap([m], [opt], loss=step(x, idx, y))


for _h in ("empty_fill", "full_like", "empty_copy_flip"):
    reg(f"read_global_{_h}_capture", global_fill, how=_h)
    reg(f"read_global_{_h}_trainstep", global_fill, how=_h, api="step")


# ====================================================================================== main
def main(argv):
    return run_table(PATTERNS, argv, name_width=58, detail_cap=None)


if __name__ == "__main__":
    main(sys.argv[1:])
