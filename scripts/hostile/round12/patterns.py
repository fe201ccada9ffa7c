"""Round 12 hostile patterns: the cached walk of modules outside the model (guards/keys.py
_Outside, guards/watch.py watch_outside). Run:

  OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round12/patterns.py [name-prefix ...]

The harness (scripts/hostile/harness.py, round 9's profile): each pattern runs the same loop twice
from one seed (eager, then replaykit) and compares every parameter, grad (None pattern), buffer,
optimizer state and loss per step.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import Patterns, data, run_table

PATTERNS = Patterns()
reg = PATTERNS.reg
STEPS = 6


def mse(a, b):
    return (a - b).pow(2).mean()


class Net(nn.Module):
    def __init__(self, drop=0.0, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.drop = nn.Dropout(drop)
        self.mid = nn.Linear(8, 8)  # square: a transposed .data keeps its data_ptr
        self.fc2 = nn.Linear(8, 3)
        self.temp = None  # plain tensor attribute
        self.cfg = None  # e.g. ([1.0],)
        self.extra = None  # dict / list / tuple holding a tensor
        self.act = None  # a plain function attribute

    def forward(self, x):
        h = self.drop(self.bn(self.fc1(x)).relu())
        h = self.mid(h)
        if self.act is not None:
            h = self.act(h)
        y = self.fc2(h)
        if self.temp is not None:
            y = y / self.temp
        if self.cfg is not None:
            y = y * self.cfg[0][0]
        if self.extra is not None:
            e = self.extra
            y = y * (
                e["s"] if isinstance(e, dict) else e[0] if isinstance(e, (list, tuple)) else e.s
            )
        s = getattr(self, "scale", None)
        if s is not None:
            y = y * s
        return y


class Doubled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = 1.5

    def forward(self, w):
        return w * self.s


class Box:
    pass


def frozen(m, train=False):
    m.requires_grad_(False)
    return m.train(train)


def make_act(s0):
    s = s0

    def act(h):
        return h * s

    def set_(v):
        nonlocal s
        s = v

    return act, set_


def act_default(h, k=1.0):
    return h * k


# ============================================================ changes: ch(i, T, st) before step i
def c_none(i, T, st):
    pass


def c_objset_temp(i, T, st):
    if i == 2:
        object.__setattr__(T, "temp", torch.tensor(2.0))


def c_dict_temp(i, T, st):
    if i == 2:
        T.__dict__["temp"] = torch.tensor(2.0)


def c_vars_temp_change(i, T, st):  # tensor temp set with setattr first, then replaced via vars()
    if i == 0:
        T.temp = torch.tensor(1.5)
    if i == 2:
        vars(T)["temp"] = torch.tensor(3.0)


def c_objset_forward(i, T, st):
    if i == 2:
        object.__setattr__(T.fc2, "forward", lambda x: nn.functional.linear(x, T.fc2.weight) * 2)


def c_dict_training(i, T, st):  # BN teacher in train mode; eval through __dict__
    if i == 2:
        T.bn.__dict__["training"] = False


def c_eval(i, T, st):
    if i == 2:
        T.eval()


def c_dict_bn_momentum(i, T, st):
    if i == 2:
        T.bn.__dict__["momentum"] = 0.5


def c_bn_momentum(i, T, st):
    if i == 2:
        T.bn.momentum = 0.5


def c_bn_eps(i, T, st):
    if i == 2:
        T.bn.eps = 0.5


def c_dict_drop_p(i, T, st):
    if i == 2:
        T.drop.__dict__["p"] = 0.5


def c_drop_p(i, T, st):
    if i == 2:
        T.drop.p = 0.5


def c_params_wholesale(i, T, st):
    if i == 2:
        w = T.fc2.weight.detach() * 0.5
        T.fc2._parameters = {"weight": nn.Parameter(w, False), "bias": T.fc2.bias}


def c_params_wholesale_dict(i, T, st):
    if i == 2:
        w = T.fc2.weight.detach() * 0.5
        T.fc2.__dict__["_parameters"] = {"weight": nn.Parameter(w, False), "bias": T.fc2.bias}


def c_params_ior(i, T, st):
    if i == 2:
        T.fc2._parameters |= {"weight": nn.Parameter(T.fc2.weight.detach() * 0.5, False)}


def c_params_dict_setitem(i, T, st):
    if i == 2:
        dict.__setitem__(
            T.fc2._parameters, "weight", nn.Parameter(T.fc2.weight.detach() * 0.5, False)
        )


def c_modules_ior(i, T, st):
    if i == 2:
        T._modules |= {"fc2": nn.Linear(8, 3).requires_grad_(False)}


def c_register_buffer(i, T, st):
    if i == 2:
        T.register_buffer("scale", torch.tensor(2.0))


def c_register_parameter(i, T, st):
    if i == 2:
        T.register_parameter("scale", nn.Parameter(torch.tensor(2.0), requires_grad=False))


def c_del_weight_plain(i, T, st):
    if i == 2:
        w = T.fc2.weight.detach() * 0.5
        del T.fc2.weight
        T.fc2.weight = w


def c_parametrize(i, T, st):
    if i == 2:
        parametrize.register_parametrization(T.fc2, "weight", Scale())


def c_parametrize_attr(i, T, st):  # registered before the first step, its float changed midway
    if i == 0:
        parametrize.register_parametrization(T.fc2, "weight", Scale())
    if i == 2:
        T.fc2.parametrizations.weight[0].s = 3.0


def c_weight_norm(i, T, st):
    if i == 2:
        torch.nn.utils.weight_norm(T.fc2)


def c_fwd_hook(i, T, st):
    if i == 2:
        T.fc2.register_forward_hook(lambda m, a, o: o * 2)


def c_fwd_hook_root(i, T, st):
    if i == 2:
        T.register_forward_hook(lambda m, a, o: o * 2)


def c_fwd_pre_hook(i, T, st):
    if i == 2:
        T.mid.register_forward_pre_hook(lambda m, a: (a[0] * 2,))


def c_hook_removed(i, T, st):
    if i == 0:
        st["h"] = T.fc2.register_forward_hook(lambda m, a, o: o * 2)
    if i == 2:
        st["h"].remove()


def c_global_hook(i, T, st):
    if i == 2:
        st["gh"] = nn.modules.module.register_module_forward_hook(
            lambda m, a, o: o * 2 if isinstance(m, Doubled) or m is T.fc2 else o
        )
    if i == STEPS - 1:
        st["gh"].remove()


def c_apply_setattr(i, T, st):
    if i == 2:
        T.apply(lambda m: setattr(m, "p", 0.5) if isinstance(m, nn.Dropout) else None)


def c_apply_inplace(i, T, st):
    if i >= 1:
        with torch.no_grad():
            T.apply(lambda m: m.weight.mul_(0.9) if isinstance(m, nn.Linear) else None)


def c_nograd_inplace(i, T, st):
    if i >= 1:
        with torch.no_grad():
            for p in T.parameters():
                p.add_(0.01)


def c_to_double_and_back(i, T, st):
    if i == 2:
        T.double()
        T.float()


def c_half_float(i, T, st):
    if i == 2:
        T.half()
        T.float()


def c_to_double(i, T, st):
    if i == 2:
        T.to(torch.float64)


def c_transpose_data(i, T, st):
    if i == 2:
        T.mid.weight.data = T.mid.weight.data.t()


def c_as_strided_data(i, T, st):
    if i == 2:
        w = T.mid.weight.data
        T.mid.weight.data = (
            w.as_strided((8, 7), (8, 1))[:, :7]
            .contiguous()
            .new_empty(0)
            .set_(w.untyped_storage(), 0, (8, 8), (1, 8))
        )


def c_tuple_list_attr(i, T, st):
    if i == 0:
        T.cfg = ([1.0],)
    if i == 2:
        T.cfg[0][0] = 2.0


def c_list_attr(i, T, st):
    if i == 0:
        T.cfg = [[1.0]]
    if i == 2:
        T.cfg[0][0] = 2.0


def c_closure_attr(i, T, st):
    if i == 0:
        T.act, st["set"] = make_act(1.0)
    if i == 2:
        st["set"](2.0)


def c_fn_defaults(i, T, st):
    if i == 0:
        T.act = act_default
    if i == 2:
        act_default.__defaults__ = (2.0,)
    if i == STEPS - 1:
        act_default.__defaults__ = (1.0,)


def c_partial_attr(i, T, st):
    if i == 0:
        T.act = functools.partial(act_default, k=1.0)
    if i == 2:
        T.act.keywords["k"] = 2.0


def c_dict_tensor_rebind(i, T, st):
    if i == 0:
        T.extra = {"s": torch.tensor(1.0)}
    if i == 2:
        T.extra["s"].data = torch.tensor(2.0)


def c_list_tensor_rebind(i, T, st):
    if i == 0:
        T.extra = [torch.tensor(1.0)]
    if i == 2:
        T.extra[0].data = torch.tensor(2.0)


def c_tuple_tensor_rebind(i, T, st):
    if i == 0:
        T.extra = (torch.tensor(1.0),)
    if i == 2:
        T.extra[0].data = torch.tensor(2.0)


def c_obj_tensor_rebind(i, T, st):
    if i == 0:
        b = Box()
        b.s = torch.tensor(1.0)
        T.extra = b
    if i == 2:
        T.extra.s.data = torch.tensor(2.0)


def c_tensor_attr_rebind(i, T, st):
    if i == 0:
        T.temp = torch.tensor(1.0)
    if i == 2:
        T.temp.data = torch.tensor(2.0)


def c_class_swap(i, T, st):
    if i == 2:
        T.fc2.__class__ = Doubled


def c_class_swap_dict(i, T, st):  # the swap through object.__setattr__
    if i == 2:
        object.__setattr__(T.fc2, "__class__", Doubled)


def c_swap_tensors(i, T, st):
    if i == 2:
        torch.utils.swap_tensors(T.fc2.weight, nn.Parameter(T.fc2.weight.detach() * 0.5, False))


def c_load_inplace_every(i, T, st):
    if i >= 1:
        T.load_state_dict(st["S"].state_dict())


def c_load_assign(i, T, st):
    if i == 3:
        T.load_state_dict({k: v.clone() for k, v in st["S"].state_dict().items()}, assign=True)
        T.requires_grad_(False)


def c_unfreeze_rg(i, T, st):
    if i == 2:
        T.fc2.weight.requires_grad_(True)


def c_history_list(i, T, st):  # false-refusal probe: a list nobody's forward reads
    if i == 0:
        T.history = []
    T.history.append(i)


def c_history_dict(i, T, st):  # false-refusal probe: a stats dict updated outside
    if i == 0:
        T.stats = {"n": 0}
    T.stats["n"] += 1


def c_toggle_back(i, T, st):  # A -> B -> A: coverage (version is a counter)
    if i == 2:
        T.drop.p = 0.1
    if i == 3:
        T.drop.p = 0.0


CHANGES = {k[2:]: v for k, v in dict(globals()).items() if k.startswith("c_")}
BN_CHANGES = {"dict_training", "eval", "dict_bn_momentum", "bn_momentum", "bn_eps"}


def teacher_in_loss(run, *, change, api="step", holder="dict"):
    """Teacher held by loss_fn's closure (dict); student trained by TrainStep."""
    torch.manual_seed(0)
    S = Net()
    bn = change in BN_CHANGES
    torch.manual_seed(1)
    T = frozen(Net(bn=bn), train=bn)
    ctx = {"t": T}
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x):
        t = ctx["t"]
        dt = next(t.parameters()).dtype
        return mse(m(x), t(x.to(dt)).float())

    if holder == "default":

        def lf(m, x, t=T):
            dt = next(t.parameters()).dtype
            return mse(m(x), t(x.to(dt)).float())

    st = {"S": S}
    step = run.step(S, lf, opt)
    for i in range(STEPS):
        CHANGES[change](i, T, st)
        (x,) = data(100 + i, (5, 6))
        loss = step(x)
        run.snap([S, T], [opt], loss=loss)


class Student(nn.Module):
    def __init__(self, T, how):
        super().__init__()
        self.net = Net()
        if how == "objset":
            object.__setattr__(self, "teacher", T)
        else:
            self.box = [T]

    def forward(self, x):
        t = self.__dict__["teacher"] if "teacher" in self.__dict__ else self.box[0]
        return self.net(x) - 0.5 * t(x)


def teacher_in_model(run, *, change, api="cap", how="list"):
    """Teacher held by the model through a plain attribute (not registered)."""
    bn = change in BN_CHANGES
    torch.manual_seed(1)
    T = frozen(Net(bn=bn), train=bn)
    torch.manual_seed(0)
    S = Student(T, how)
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9, fused=True)
    st = {"S": S.net}
    if api == "step":
        step = run.step(S, lambda m, x: m(x).pow(2).mean(), opt)
    else:
        run.wrap(S)
    for i in range(STEPS):
        CHANGES[change](i, T, st)
        (x,) = data(100 + i, (5, 6))
        if api == "step":
            loss = step(x)
        else:
            loss = S(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([S, T], [opt], loss=loss)


def two_steps_shared(run, *, change):
    torch.manual_seed(1)
    T = frozen(Net())
    torch.manual_seed(0)
    S1, S2 = Net(), Net()
    o1 = torch.optim.SGD(S1.parameters(), lr=0.1, fused=True)
    o2 = torch.optim.SGD(S2.parameters(), lr=0.1, fused=True)

    def lf(m, x):
        return mse(m(x), T(x))

    a, b = run.step(S1, lf, o1), run.step(S2, lf, o2)
    st = {"S": S1}
    for i in range(STEPS):
        CHANGES[change](i, T, st)
        (x,) = data(100 + i, (5, 6))
        la = a(x)
        lb = b(x)
        run.snap([S1, S2, T], [o1, o2], la=la, lb=lb)


def teacher_per_epoch(run, *, how):
    torch.manual_seed(0)
    S = Net()
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9, fused=True)
    ctx = {}

    def lf(m, x):
        return mse(m(x), ctx["t"](x))

    step = run.step(S, lf, opt)
    for i in range(STEPS):
        if i % 2 == 0:
            ctx.pop("t", None)
            if how == "deepcopy":
                ctx["t"] = frozen(copy.deepcopy(S))
            else:  # new object, hooks differ per epoch
                t = frozen(copy.deepcopy(S))
                k = 1.0 + i
                t.fc2.register_forward_hook(lambda m, a, o, k=k: o * k)
                ctx["t"] = t
        (x,) = data(100 + i, (5, 6))
        loss = step(x)
        run.snap([S], [opt], loss=loss)


def ema_avg(run, *, api):
    torch.manual_seed(0)
    S = Net()
    ema = torch.optim.swa_utils.AveragedModel(
        S, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    ema.requires_grad_(False)
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9, fused=True)

    def lf(m, x):
        s = m(x)
        return mse(s, ema(x + 0.1)) + s.pow(2).mean() * 0.1

    step = run.step(S, lf, opt)
    for i in range(STEPS):
        (x,) = data(100 + i, (5, 6))
        loss = step(x)
        ema.update_parameters(S)
        if api == "dictp" and i == 2:
            ema.module.fc2.__dict__["_parameters"] = dict(
                ema.module.fc2._parameters,
                weight=nn.Parameter(ema.module.fc2.weight.detach() * 0.5, False),
            )
        run.snap([S, ema], [opt], loss=loss)


def teacher_also_in_tree(run, *, change):
    """The teacher is a registered submodule of the model and also read by loss_fn."""
    torch.manual_seed(1)
    T = frozen(Net())
    torch.manual_seed(0)

    class W(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.t = T

        def forward(self, x):
            return self.net(x)

    M = W()
    opt = torch.optim.SGD(M.net.parameters(), lr=0.1, fused=True)
    step = run.step(M, lambda m, x: mse(m(x), T(x)), opt)
    st = {"S": M.net}
    for i in range(STEPS):
        CHANGES[change](i, T, st)
        (x,) = data(100 + i, (5, 6))
        loss = step(x)
        run.snap([M], [opt], loss=loss)


for _c in CHANGES:
    reg(f"L_{_c}", teacher_in_loss, change=_c)
for _c in (
    "objset_temp",
    "fwd_hook",
    "params_ior",
    "tuple_list_attr",
    "to_double",
    "transpose_data",
):
    reg(f"Ld_{_c}", teacher_in_loss, change=_c, holder="default")
for _c in (
    "none",
    "dict_temp",
    "fwd_hook",
    "fwd_pre_hook",
    "class_swap",
    "params_ior",
    "params_wholesale_dict",
    "closure_attr",
    "tuple_tensor_rebind",
    "dict_training",
    "transpose_data",
):
    reg(f"Mc_{_c}", teacher_in_model, change=_c, api="cap")
for _c in ("none", "objset_temp", "fwd_hook", "class_swap", "dict_tensor_rebind"):
    reg(f"Ms_{_c}", teacher_in_model, change=_c, api="step", how="objset")
for _c in ("none", "fwd_hook", "objset_temp", "c_register_buffer"[2:]):
    reg(f"T2_{_c}", two_steps_shared, change=_c)
for _c in ("none", "fwd_hook", "objset_temp", "class_swap", "transpose_data", "closure_attr"):
    reg(f"Tree_{_c}", teacher_also_in_tree, change=_c)
reg("P_deepcopy", teacher_per_epoch, how="deepcopy")
reg("P_hooked", teacher_per_epoch, how="hooked")
reg("E_averaged", ema_avg, api="plain")
reg("E_averaged_dictp", ema_avg, api="dictp")


def main(argv):
    return run_table(PATTERNS, argv, name_width=34, detail_cap=330)


if __name__ == "__main__":
    main(sys.argv[1:])
