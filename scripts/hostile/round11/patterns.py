"""Round 11 hostile patterns: modules reached through containers (today's change: a module in a
container loss_fn reads, or one the model keeps in a plain dict attribute, is keyed by its
tensors' identities). Run:

  OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/hostile/round11/patterns.py [name-prefix ...]

The harness is scripts/hostile/harness.py (round 9's profile). Each pattern runs the same loop
twice from one seed, eager and through replaykit, and compares every parameter, grad (None
pattern), buffer, optimizer state and loss after each step.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import types
import weakref
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import Patterns, data, run_table

PATTERNS = Patterns()
reg = PATTERNS.reg
STEPS = 6


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def mse(a, b):
    return (a - b).pow(2).mean()


class Net(nn.Module):
    """Student and teacher alike (so a copy of the student fits the teacher's slot)."""

    def __init__(self, drop=0.0, bn=False):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.drop = nn.Dropout(drop)
        self.fc2 = nn.Linear(8, 3)
        self.temp = None  # a plain tensor attribute (not a buffer) some patterns set

    def forward(self, x):
        y = self.fc2(self.drop(self.bn(self.fc1(x)).relu()))
        if self.temp is not None:
            y = y / self.temp
        return y


def frozen(m, train=False):
    m.requires_grad_(False)
    return m.train(train)


# ============================================================ teacher holders for loss_fn
# each returns (loss_fn, get, set_, append) — append None where the holder keeps one teacher


class Box:
    pass


@dataclasses.dataclass(slots=True)
class SlotState:
    teacher: nn.Module


class Distiller:
    def __init__(self, teacher):
        self.teacher = teacher

    def loss(self, m, x):
        return mse(m(x), self.teacher(x))


class DistillerNested:
    def __init__(self, teacher):
        self.pool = {"teachers": [teacher]}

    def loss(self, m, x):
        s = m(x)
        ts = self.pool["teachers"]
        return sum(mse(s, t(x)) for t in ts) / len(ts)


class DistillerModule(nn.Module):
    def __init__(self, teacher):
        super().__init__()
        self.teacher = teacher

    def loss(self, m, x):
        return mse(m(x), self.teacher(x))


class KDLoss(nn.Module):
    def __init__(self, teacher):
        super().__init__()
        self.teacher = teacher

    def forward(self, m, x):
        return mse(m(x), self.teacher(x))


class KDLossList(nn.Module):
    def __init__(self, teacher):
        super().__init__()
        self.teachers = nn.ModuleList([teacher])

    def forward(self, m, x):
        s = m(x)
        return sum(mse(s, t(x)) for t in self.teachers) / len(self.teachers)


class KDLossHidden(nn.Module):
    """The common trick: the teacher in a plain list attribute, so that it is neither registered
    nor saved with the criterion's state_dict."""

    def __init__(self, teacher):
        super().__init__()
        self._teacher = [teacher]

    def forward(self, m, x):
        return mse(m(x), self._teacher[0](x))


class Owner(nn.Module):
    """A LightningModule-like owner: holds the model (registered) and the teacher hidden in a list."""

    def __init__(self, model, teacher):
        super().__init__()
        self.model = model
        self.teacher_box = [teacher]

    def training_loss(self, m, x):
        return mse(m(x), self.teacher_box[0](x))


TEACHER = None
MODELS: dict = {}
CFG = Box()


def _global_lf(m, x):
    return mse(m(x), TEACHER(x))


def _global_dict_lf(m, x):
    return mse(m(x), MODELS["teacher"](x))


def _global_deep_lf(m, x):
    s = m(x)
    ts = CFG.models["teachers"]
    return sum(mse(s, t(x)) for t in ts) / len(ts)


def _kd(m, x, teacher):
    return mse(m(x), teacher(x))


def _kd_list(m, x, teachers):
    s = m(x)
    return sum(mse(s, t(x)) for t in teachers) / len(teachers)


def h_closure(T):
    teacher = T

    def lf(m, x):
        return mse(m(x), teacher(x))

    def set_(t):
        nonlocal teacher
        teacher = t

    return lf, lambda: teacher, set_, None


def h_dict(T):
    ctx = {"teacher": T}
    return (
        lambda m, x: mse(m(x), ctx["teacher"](x)),
        lambda: ctx["teacher"],
        lambda t: ctx.__setitem__("teacher", t),
        None,
    )


def h_list(T):
    ts = [T]

    def lf(m, x):
        s = m(x)
        return sum(mse(s, t(x)) for t in ts) / len(ts)

    return lf, lambda: ts[0], lambda t: ts.__setitem__(0, t), ts.append


def h_ns(T):
    ns = types.SimpleNamespace(teacher=T)
    return (
        lambda m, x: mse(m(x), ns.teacher(x)),
        lambda: ns.teacher,
        lambda t: setattr(ns, "teacher", t),
        None,
    )


def h_obj(T):
    b = Box()
    b.teacher = T
    return (
        lambda m, x: mse(m(x), b.teacher(x)),
        lambda: b.teacher,
        lambda t: setattr(b, "teacher", t),
        None,
    )


def h_dict_list(T):
    ctx = {"teachers": [T]}

    def lf(m, x):
        s = m(x)
        return sum(mse(s, t(x)) for t in ctx["teachers"]) / len(ctx["teachers"])

    return (
        lf,
        lambda: ctx["teachers"][0],
        lambda t: ctx["teachers"].__setitem__(0, t),
        ctx["teachers"].append,
    )


def h_obj_dict(T):
    b = Box()
    b.models = {"teacher": T}
    return (
        lambda m, x: mse(m(x), b.models["teacher"](x)),
        lambda: b.models["teacher"],
        lambda t: b.models.__setitem__("teacher", t),
        None,
    )


def h_obj_dict_list(T):
    b = Box()
    b.models = {"teachers": [T]}

    def lf(m, x):
        s = m(x)
        ts = b.models["teachers"]
        return sum(mse(s, t(x)) for t in ts) / len(ts)

    ts = b.models["teachers"]
    return lf, lambda: ts[0], lambda t: ts.__setitem__(0, t), ts.append


def h_global(T):
    global TEACHER
    TEACHER = T

    def set_(t):
        global TEACHER
        TEACHER = t

    return _global_lf, lambda: TEACHER, set_, None


def h_global_dict(T):
    MODELS.clear()
    MODELS["teacher"] = T
    return (
        _global_dict_lf,
        lambda: MODELS["teacher"],
        lambda t: MODELS.__setitem__("teacher", t),
        None,
    )


def h_global_deep(T):
    CFG.models = {"teachers": [T]}
    ts = CFG.models["teachers"]
    return _global_deep_lf, lambda: ts[0], lambda t: ts.__setitem__(0, t), ts.append


def h_method(T):
    d = Distiller(T)
    return d.loss, lambda: d.teacher, lambda t: setattr(d, "teacher", t), None


def h_method_nested(T):
    d = DistillerNested(T)
    ts = d.pool["teachers"]
    return d.loss, lambda: ts[0], lambda t: ts.__setitem__(0, t), ts.append


def h_method_module(T):
    d = DistillerModule(T)
    return d.loss, lambda: d.teacher, lambda t: setattr(d, "teacher", t), None


def h_criterion(T):
    k = KDLoss(T)
    return k, lambda: k.teacher, lambda t: setattr(k, "teacher", t), None


def h_criterion_list(T):
    k = KDLossList(T)
    return k, lambda: k.teachers[0], lambda t: k.teachers.__setitem__(0, t), k.teachers.append


def h_criterion_hidden_list(T):
    k = KDLossHidden(T)
    return k, lambda: k._teacher[0], lambda t: k._teacher.__setitem__(0, t), None


def h_partial(T):
    lf = functools.partial(_kd, teacher=T)
    return lf, lambda: lf.keywords["teacher"], None, None


def h_partial_list(T):
    ts = [T]
    lf = functools.partial(_kd_list, teachers=ts)
    return lf, lambda: ts[0], lambda t: ts.__setitem__(0, t), ts.append


def h_default(T):
    def lf(m, x, teacher=T):
        return mse(m(x), teacher(x))

    return lf, lambda: T, None, None


def h_default_list(T):
    ts = [T]

    def lf(m, x, teachers=ts):
        s = m(x)
        return sum(mse(s, t(x)) for t in teachers) / len(teachers)

    return lf, lambda: ts[0], lambda t: ts.__setitem__(0, t), ts.append


def h_default_dict(T):
    models = {"teacher": T}

    def lf(m, x, models=models):
        return mse(m(x), models["teacher"](x))

    return lf, lambda: models["teacher"], lambda t: models.__setitem__("teacher", t), None


def h_kwdefault_dict(T):
    models = {"teacher": T}

    def lf(m, x, *, models=models):
        return mse(m(x), models["teacher"](x))

    return lf, lambda: models["teacher"], lambda t: models.__setitem__("teacher", t), None


def h_slots(T):
    st = SlotState(T)
    return (
        lambda m, x: mse(m(x), st.teacher(x)),
        lambda: st.teacher,
        lambda t: setattr(st, "teacher", t),
        None,
    )


def h_weakref(T):  # a weak reference (the loop keeps the teacher alive)
    tref = weakref.ref(T)

    def lf(m, x):
        return mse(m(x), tref()(x))

    return lf, lambda: tref(), None, None


def h_moduledict(T):
    md = nn.ModuleDict({"teacher": T})
    return (
        lambda m, x: mse(m(x), md["teacher"](x)),
        lambda: md["teacher"],
        lambda t: md.__setitem__("teacher", t),
        None,
    )


def h_modulelist(T):
    ml = nn.ModuleList([T])

    def lf(m, x):
        s = m(x)
        return sum(mse(s, t(x)) for t in ml) / len(ml)

    return lf, lambda: ml[0], lambda t: ml.__setitem__(0, t), ml.append


def h_tuple_in_dict(T):  # (teacher, weight) pairs in a dict
    ctx = {"pairs": [(T, 1.0)]}

    def lf(m, x):
        s = m(x)
        return sum(w * mse(s, t(x)) for t, w in ctx["pairs"])

    return lf, lambda: ctx["pairs"][0][0], lambda t: ctx["pairs"].__setitem__(0, (t, 1.0)), None


HOLDERS = {k[2:]: v for k, v in dict(globals()).items() if k.startswith("h_")}


# ============================================================ changes
# each is change(i, st) with st: dict(get, set_, append, student, T2, extra)


def c_none(i, st):
    pass


def c_assign_load(i, st):
    if i in (2, 4):
        t = st["get"]()
        t.load_state_dict({k: v * 0.9 for k, v in t.state_dict().items()}, assign=True)


def c_assign_load_every(i, st):
    if i >= 1:
        t = st["get"]()
        t.load_state_dict({k: v * 0.9 for k, v in t.state_dict().items()}, assign=True)


def c_inplace_load(i, st):
    if i in (2, 4):
        t = st["get"]()
        t.load_state_dict({k: v * 0.9 for k, v in t.state_dict().items()})


def c_new_param(i, st):
    if i in (2, 4):
        t = st["get"]()
        t.fc2.weight = nn.Parameter(t.fc2.weight.detach() * 0.9, requires_grad=False)


def c_data(i, st):
    if i >= 1:
        for p in st["get"]().parameters():
            p.data = p.data * 0.9


def c_swap_tensors(i, st):
    if i in (2, 4):
        t = st["get"]()
        torch.utils.swap_tensors(
            t.fc2.weight, nn.Parameter(t.fc2.weight.detach() * 0.9, requires_grad=False)
        )


def c_half_float(i, st):
    if i in (2, 4):
        st["get"]().half().float()


def c_half_float_overwrite(i, st):
    if i in (2, 4):
        old = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            st["get"]().half().float()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(old)


def c_half_float_swap(i, st):
    if i in (2, 4):
        old = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            st["get"]().half().float()
        finally:
            torch.__future__.set_swap_module_params_on_conversion(old)


def c_deepcopy_student(i, st):
    if i in (2, 4):
        st["set_"](frozen(copy.deepcopy(st["student"])))


def c_vector_to_params(i, st):
    if i in (2, 4):
        t = st["get"]()
        v = nn.utils.parameters_to_vector(t.parameters())
        nn.utils.vector_to_parameters(v * 0.9, t.parameters())


def c_bn_buffer_assigned(i, st):  # teacher with BN (eval): running stats replaced by new tensors
    if i in (2, 4):
        bn = st["get"]().bn
        bn.running_mean = bn.running_mean * 0.5 + 0.1
        bn.running_var = bn.running_var * 2.0


def c_bn_register_buffer(i, st):
    if i in (2, 4):
        bn = st["get"]().bn
        bn.register_buffer("running_var", bn.running_var * 3.0)


def c_requires_grad_on(i, st):
    if i == 3:
        st["get"]().requires_grad_(True)


def c_train_flip(i, st):  # dropout teacher, eval at first
    if i == 3:
        st["get"]().train()
    if i == 5:
        st["get"]().eval()


def c_swap_key(i, st):
    if i == 3:
        st["set_"](st["T2"])
    if i == 5:
        st["set_"](st["T"])


def c_append_second(i, st):
    if i == 3:
        st["append"](st["T2"])


def c_submodule_replace(i, st):
    if i == 3:
        t = st["get"]()
        torch.manual_seed(99)
        t.fc2 = frozen(nn.Linear(8, 3))


def c_sequential_slot_replace(i, st):  # head copied from the student into the teacher
    if i in (2, 4):
        st["get"]().fc2 = frozen(copy.deepcopy(st["student"].fc2))


def c_temp_tensor_attr(i, st):  # a plain tensor attribute re-bound (DINO's centre / temperature)
    if i == 0:
        st["get"]().temp = torch.tensor(1.0)
    if i >= 2:
        st["get"]().temp = torch.tensor(1.0 + 0.5 * i)


def c_set_then_reload(i, st):  # a new teacher object in the slot, then reloaded as new tensors
    if i == 1:
        st["set_"](st["T2"])
    if i in (3, 5):
        t = st["get"]()
        t.load_state_dict({k: v * 0.9 for k, v in t.state_dict().items()}, assign=True)


def c_set_then_train_flip(i, st):  # a new teacher object in the slot, then put in train mode
    if i == 1:
        st["set_"](st["T2"])
    if i == 3:
        st["get"]().train()


def c_set_then_requires_grad(i, st):
    if i == 1:
        st["set_"](st["T2"])
    if i == 3:
        st["get"]().requires_grad_(True)


CHANGES = {k[2:]: v for k, v in dict(globals()).items() if k.startswith("c_")}


def distill(run, *, holder, change, teacher_kw=None, opt_kind="sgd"):
    torch.manual_seed(0)
    S = Net()
    kw = teacher_kw or {}
    T = frozen(Net(**kw))
    T2 = frozen(Net(**kw))
    if kw.get("bn"):
        with torch.no_grad():
            for t in (T, T2):
                t.bn.running_mean.copy_(seeded(7, 8))
                t.bn.running_var.copy_(seeded(8, 8).abs() + 0.5)
    opt = (
        torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9)
        if opt_kind == "sgd"
        else torch.optim.AdamW(S.parameters(), lr=1e-2)
    )
    lf, get, set_, append = HOLDERS[holder](T)
    st = dict(get=get, set_=set_, append=append, student=S, T=T, T2=T2)
    step = run.step(S, lf, opt)
    for i in range(STEPS):
        CHANGES[change](i, st)
        (x,) = data(500 + i, (5, 6))
        loss = step(x)
        run.snap([S, get(), T2], [opt], loss=loss)


def distill_arg(run, *, change):
    """The teacher handed to the step as an argument each call: ``step(x, teacher)``."""
    torch.manual_seed(0)
    S, T, T2 = Net(), frozen(Net()), frozen(Net())
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9)
    cur = {"t": T}
    st = dict(
        get=lambda: cur["t"],
        set_=lambda t: cur.__setitem__("t", t),
        append=None,
        student=S,
        T=T,
        T2=T2,
    )
    step = run.step(S, _kd, opt)
    for i in range(STEPS):
        CHANGES[change](i, st)
        (x,) = data(500 + i, (5, 6))
        loss = step(x, cur["t"])
        run.snap([S, cur["t"], T2], [opt], loss=loss)


for _c in ("none", "assign_load", "submodule_replace", "deepcopy_student", "requires_grad_on"):
    reg(f"A_arg__{_c}", distill_arg, change=_c)


def owner_distill(run, *, change):
    """loss_fn is a method of a module that holds the model (a LightningModule) and keeps the
    teacher in a plain list attribute."""
    torch.manual_seed(0)
    S, T, T2 = Net(), frozen(Net()), frozen(Net())
    o = Owner(S, T)
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9)
    st = dict(
        get=lambda: o.teacher_box[0],
        set_=lambda t: o.teacher_box.__setitem__(0, t),
        append=None,
        student=S,
        T=T,
        T2=T2,
    )
    step = run.step(S, o.training_loss, opt)
    for i in range(STEPS):
        CHANGES[change](i, st)
        (x,) = data(500 + i, (5, 6))
        loss = step(x)
        run.snap([S, st["get"](), T2], [opt], loss=loss)


for _c in ("none", "assign_load", "deepcopy_student", "submodule_replace"):
    reg(f"W_owner_hidden_list__{_c}", owner_distill, change=_c)


def rebuilt_teacher(run, *, api, kind):
    """The model's teacher dict is emptied (the old teacher freed: ``held.clear()`` to save
    memory) and a new teacher built and put in: the new module takes the freed one's id (CPython
    reuses the block at once), which is all the dict's key holds of it."""
    torch.manual_seed(0)
    make = (lambda: frozen(nn.Linear(6, 3))) if kind == "linear" else (lambda: frozen(Net()))
    m = Holding("dict", make())
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1, momentum=0.9)
    lf = lambda mod, x: mod(x).pow(2).mean()  # noqa: E731
    step = run.step(m, lf, opt) if api == "step" else run.wrap(m)
    same_id = []
    for i in range(STEPS):
        if i in (2, 4):
            old = id(m.held["teacher"])
            m.held.clear()
            torch.manual_seed(50 + i)
            m.held["teacher"] = make()
            same_id.append(old == id(m.held["teacher"]))
        (x,) = data(800 + i, (5, 6))
        if api == "step":
            loss = step(x)
        else:
            loss = lf(m, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m.net, m.get_teacher()], [opt], loss=loss)
    if run.rk:
        print(f"    (the rebuilt teacher took the freed one's id: {same_id})")


for _api in ("step", "cap"):
    for _k in ("linear", "net"):
        reg(f"R_rebuilt_teacher_{_k}_{_api}", rebuilt_teacher, api=_api, kind=_k)


def cotrain(run, *, holder):
    """Mutual learning: the teacher is unfrozen at step 3 and from then on trained by its own
    optimizer on the gradients the student's step leaves on it."""
    torch.manual_seed(0)
    S, T = Net(), frozen(Net())
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9)
    t_opt = torch.optim.SGD(T.parameters(), lr=0.05)
    lf, _get, _, _ = HOLDERS[holder](T)
    step = run.step(S, lf, opt)
    for i in range(STEPS):
        if i == 3:
            T.requires_grad_(True)
        (x,) = data(500 + i, (5, 6))
        loss = step(x)
        t_opt.step()
        t_opt.zero_grad()
        run.snap([S, T], [opt, t_opt], loss=loss)


for _h in ("closure", "dict", "criterion"):
    reg(f"C_cotrain_{_h}", cotrain, holder=_h)


# -------------------------------------------------------------- which holder × change
ALL_HOLDERS = list(HOLDERS)
# every holder: nothing changes (must replay), weights loaded as new tensors (today's change)
for _h in ALL_HOLDERS:
    reg(f"L_{_h}__none", distill, holder=_h, change="none")
    reg(f"L_{_h}__assign_load", distill, holder=_h, change="assign_load")

# the main holders: many ways of changing the teacher
for _h in ("closure", "dict", "obj_dict", "method_module", "criterion"):
    for _c in (
        "new_param",
        "swap_tensors",
        "half_float_overwrite",
        "submodule_replace",
        "temp_tensor_attr",
        "requires_grad_on",
    ):
        reg(f"L_{_h}__{_c}", distill, holder=_h, change=_c)
for _h in ("dict",):
    for _c in (
        "inplace_load",
        "data",
        "half_float",
        "half_float_swap",
        "vector_to_params",
        "assign_load_every",
        "sequential_slot_replace",
    ):
        reg(f"L_{_h}__{_c}", distill, holder=_h, change=_c)
    reg(
        f"L_{_h}__bn_buffer_assigned",
        distill,
        holder=_h,
        change="bn_buffer_assigned",
        teacher_kw=dict(bn=True),
    )
    reg(
        f"L_{_h}__bn_register_buffer",
        distill,
        holder=_h,
        change="bn_register_buffer",
        teacher_kw=dict(bn=True),
    )
    reg(f"L_{_h}__train_flip", distill, holder=_h, change="train_flip", teacher_kw=dict(drop=0.5))
# replacing the object in the slot
for _h in (
    "dict",
    "list",
    "obj",
    "closure",
    "method",
    "method_module",
    "criterion",
    "moduledict",
    "slots",
    "dict_list",
):
    reg(f"L_{_h}__deepcopy_student", distill, holder=_h, change="deepcopy_student")
for _h in ("dict", "moduledict", "criterion"):
    reg(f"L_{_h}__swap_key", distill, holder=_h, change="swap_key")
    reg(f"L_{_h}__set_then_reload", distill, holder=_h, change="set_then_reload")
for _h in (
    "list",
    "dict_list",
    "modulelist",
    "criterion_list",
    "partial_list",
    "default_list",
    "method_nested",
    "global_deep",
    "obj_dict_list",
):
    reg(f"L_{_h}__append_second", distill, holder=_h, change="append_second")
reg("L_dict__assign_load_adamw", distill, holder="dict", change="assign_load", opt_kind="adamw")


# ============================================================ teachers the MODEL holds
class Holding(nn.Module):
    """A student whose forward subtracts a frozen teacher it keeps outside its registered tree."""

    def __init__(self, how, T):
        super().__init__()
        self.net = Net()
        self.how = how
        if how == "dict":
            self.held = {"teacher": T}
        elif how == "list":
            self.held = [T]
        elif how == "tuple":
            self.held = (T,)
        elif how == "dict_list":
            self.held = {"teachers": [T]}
        elif how == "ns":
            self.aux = types.SimpleNamespace(teacher=T)
        elif how == "obj":
            self.aux = Box()
            self.aux.teacher = T
        elif how == "setattr":
            object.__setattr__(self, "teacher", T)
        elif how == "weakref":
            self.tref = weakref.ref(T)
        elif how == "bound_call":
            self.teacher_fn = T.__call__
        elif how == "global":
            global MTEACHER
            MTEACHER = T
        else:
            raise ValueError(how)

    def get_teacher(self):  # only the loop and the test read through this
        h = self.how
        if h == "dict":
            return self.held.get("teacher")
        if h in ("list", "tuple"):
            return self.held[0]
        if h == "dict_list":
            return self.held["teachers"][0]
        if h in ("ns", "obj"):
            return self.aux.teacher
        if h == "setattr":
            return self.__dict__["teacher"]
        if h == "weakref":
            return self.tref()
        if h == "bound_call":
            return self.teacher_fn.__self__
        return MTEACHER

    def set_teacher(self, t):
        h = self.how
        if h == "dict":
            self.held["teacher"] = t
        elif h == "list":
            self.held[0] = t
        elif h == "tuple":
            self.held = (t,)
        elif h == "dict_list":
            self.held["teachers"][0] = t
        elif h in ("ns", "obj"):
            self.aux.teacher = t
        elif h == "setattr":
            object.__setattr__(self, "teacher", t)
        elif h == "weakref":
            self.tref = weakref.ref(t)
        elif h == "bound_call":
            self.teacher_fn = t.__call__
        else:
            global MTEACHER
            MTEACHER = t

    def forward(self, x):
        h = self.how
        if h == "dict":
            t = self.held["teacher"](x) if "teacher" in self.held else 0.0
        elif h in ("list", "tuple"):
            t = self.held[0](x)
        elif h == "dict_list":
            t = self.held["teachers"][0](x)
        elif h in ("ns", "obj"):
            t = self.aux.teacher(x)
        elif h == "setattr":
            t = self.__dict__["teacher"](x)
        elif h == "weakref":
            t = self.tref()(x)
        elif h == "bound_call":
            t = self.teacher_fn(x)
        else:
            t = MTEACHER(x)
        return self.net(x) - t


MTEACHER = None


def held_by_model(run, *, how, change, api, teacher_kw=None):
    torch.manual_seed(0)
    kw = teacher_kw or {}
    T = frozen(Net(**kw))
    T2 = frozen(Net(**kw))
    m = Holding(how, T)
    keep = [T, T2]  # the weakref holder needs the teachers alive
    opt = torch.optim.SGD(m.net.parameters(), lr=0.1, momentum=0.9)
    lf = lambda mod, x: mod(x).pow(2).mean()  # noqa: E731
    st = dict(get=m.get_teacher, set_=m.set_teacher, append=None, student=m.net, T=T, T2=T2)
    step = run.step(m, lf, opt) if api == "step" else run.wrap(m)
    for i in range(STEPS):
        CHANGES[change](i, st)
        (x,) = data(800 + i, (5, 6))
        if api == "step":
            loss = step(x)
        else:
            loss = lf(m, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m.net, m.get_teacher(), T2], [opt], loss=loss)
    del keep


for _how in (
    "dict",
    "list",
    "tuple",
    "dict_list",
    "ns",
    "obj",
    "setattr",
    "weakref",
    "bound_call",
    "global",
):
    for _api in ("step", "cap"):
        reg(f"M_{_how}__none_{_api}", held_by_model, how=_how, change="none", api=_api)
        reg(
            f"M_{_how}__assign_load_{_api}", held_by_model, how=_how, change="assign_load", api=_api
        )
for _how in ("dict", "list"):
    for _api in ("step", "cap"):
        for _c in (
            "deepcopy_student",
            "set_then_reload",
            "submodule_replace",
            "requires_grad_on",
            "new_param",
            "temp_tensor_attr",
        ):
            reg(f"M_{_how}__{_c}_{_api}", held_by_model, how=_how, change=_c, api=_api)
        reg(
            f"M_{_how}__train_flip_{_api}",
            held_by_model,
            how=_how,
            change="train_flip",
            api=_api,
            teacher_kw=dict(drop=0.5),
        )
        reg(
            f"M_{_how}__bn_buffer_assigned_{_api}",
            held_by_model,
            how=_how,
            change="bn_buffer_assigned",
            api=_api,
            teacher_kw=dict(bn=True),
        )
for _how in ("dict", "list"):
    for _api in ("step", "cap"):
        reg(
            f"M_{_how}__set_then_train_flip_{_api}",
            held_by_model,
            how=_how,
            change="set_then_train_flip",
            api=_api,
            teacher_kw=dict(drop=0.5),
        )
        reg(
            f"M_{_how}__set_then_requires_grad_{_api}",
            held_by_model,
            how=_how,
            change="set_then_requires_grad",
            api=_api,
        )
for _how in ("ns", "setattr"):
    for _api in ("step", "cap"):
        reg(
            f"M_{_how}__train_flip_{_api}",
            held_by_model,
            how=_how,
            change="train_flip",
            api=_api,
            teacher_kw=dict(drop=0.5),
        )


# ============================================================ the model's own modules changed
class Own(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.emb.weight.requires_grad_(False)  # frozen pretrained table
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.bn(self.fc(self.emb(ids).mean(1))).relu())


def own(run, *, change, api):
    torch.manual_seed(0)
    m = Own()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    lf = lambda mod, ids, y: torch.nn.functional.cross_entropy(mod(ids), y)  # noqa: E731
    step = run.step(m, lf, opt) if api == "step" else run.wrap(m)
    for i in range(STEPS):
        if i in (2, 4):
            new = seeded(30 + i, 10, 6)
            if change == "emb_new_param":
                m.emb.weight = nn.Parameter(new, requires_grad=False)
            elif change == "emb_load_assign":
                m.emb.load_state_dict({"weight": new}, assign=True)
            elif change == "emb_load_inplace":
                m.emb.load_state_dict({"weight": new})
            elif change == "emb_from_pretrained":
                m.emb = nn.Embedding.from_pretrained(new)
            elif change == "emb_data":
                m.emb.weight.data = new
            elif change == "emb_swap_tensors":
                torch.utils.swap_tensors(m.emb.weight, nn.Parameter(new, requires_grad=False))
            elif change == "bn_stats_assigned":
                m.bn.running_mean = torch.zeros(8)
                m.bn.running_var = torch.ones(8) * 2
            elif change == "bn_register_buffer":
                m.bn.register_buffer("running_mean", m.bn.running_mean.clone() + 1)
            elif change == "half_float_swap_flag":  # torch's swap path for module conversion
                old = torch.__future__.get_swap_module_params_on_conversion()
                torch.__future__.set_swap_module_params_on_conversion(True)
                try:
                    m.head.half().float()
                finally:
                    torch.__future__.set_swap_module_params_on_conversion(old)
            elif change == "vector_to_params":
                ps = list(m.head.parameters())
                nn.utils.vector_to_parameters(nn.utils.parameters_to_vector(ps) * 0.9, ps)
            elif change == "emb_unfreeze":
                if i == 2:
                    m.emb.weight.requires_grad_(True)
            elif change == "none":
                pass
            else:
                raise ValueError(change)
        (ids,) = [torch.randint(0, 10, (5, 4), generator=torch.Generator().manual_seed(900 + i))]
        y = torch.tensor([0, 1, 2, 1, 0])
        if api == "step":
            loss = step(ids, y)
        else:
            loss = lf(m, ids, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
        run.snap([m], [opt], loss=loss)


for _c in (
    "none",
    "emb_new_param",
    "emb_load_assign",
    "emb_load_inplace",
    "emb_from_pretrained",
    "emb_data",
    "emb_swap_tensors",
    "bn_stats_assigned",
    "bn_register_buffer",
    "vector_to_params",
    "emb_unfreeze",
    "half_float_swap_flag",
):
    for _api in ("step", "cap"):
        reg(f"O_{_c}_{_api}", own, change=_c, api=_api)


# ============================================================ mean teacher (EMA through a dict)
def mean_teacher(run, *, how, api="step"):
    torch.manual_seed(0)
    S = Net()
    if how == "averaged_model":
        ema = torch.optim.swa_utils.AveragedModel(
            S, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        )
        ema.requires_grad_(False)
    else:
        ema = frozen(copy.deepcopy(S))
    ctx = {"ema": ema}
    opt = torch.optim.SGD(S.parameters(), lr=0.1, momentum=0.9)

    def lf(m, x):
        s = m(x)
        return mse(s, ctx["ema"](x + 0.1)) + s.pow(2).mean() * 0.1

    step = run.step(S, lf, opt)
    for i in range(STEPS):
        (x,) = data(600 + i, (5, 6))
        loss = step(x)
        with torch.no_grad():
            e = ctx["ema"]
            if how == "inplace":
                for pe, ps in zip(e.parameters(), S.parameters(), strict=True):
                    pe.mul_(0.9).add_(ps, alpha=0.1)
            elif how == "rebind":
                for pe, ps in zip(e.parameters(), S.parameters(), strict=True):
                    pe.data = pe.data * 0.9 + ps.data * 0.1
            elif how == "assign":
                sd = {k: 0.9 * v + 0.1 * S.state_dict()[k] for k, v in e.state_dict().items()}
                e.load_state_dict(sd, assign=True)
            elif how == "foreach_lerp":
                torch._foreach_lerp_(list(e.parameters()), list(S.parameters()), 0.1)
            elif how == "averaged_model":
                e.update_parameters(S)
            elif how == "replace_object" and i % 2 == 1:
                ctx["ema"] = frozen(copy.deepcopy(S))
        run.snap([S, ctx["ema"]], [opt], loss=loss)


for _how in ("inplace", "rebind", "assign", "foreach_lerp", "averaged_model", "replace_object"):
    reg(f"E_{_how}", mean_teacher, how=_how)


def main(argv):
    return run_table(PATTERNS, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
