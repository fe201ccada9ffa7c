"""A few round-11 patterns on a real CUDA graph (backend="cuda"), eager vs replaykit, bitwise.
The emulated tape keeps a constant (a frozen teacher's weight) by its Python object, so a
``p.data = ...`` re-bind is read anew there; a CUDA graph reads the captured address.

  PYTHONPATH=. python3 scripts/hostile/round11/cuda_check.py [emulated|cuda]
"""

import sys
import types
import warnings

import torch
from torch import nn

import replaykit as rk

warnings.simplefilter("ignore")
BACKEND = sys.argv[1] if len(sys.argv) > 1 else "cuda"
DEV = "cuda" if BACKEND == "cuda" else "cpu"
if DEV == "cuda":
    rk.enable_determinism()


def lin():
    return nn.Linear(6, 3).to(DEV)


def reload(t):
    t.load_state_dict({k: v * 0.9 for k, v in t.state_dict().items()}, assign=True)


def rebind(t):
    for p in t.parameters():
        p.data = p.data * 0.9


def v2p(t):
    v = nn.utils.parameters_to_vector(t.parameters())
    nn.utils.vector_to_parameters(v * 0.9, t.parameters())


def half_float(t):
    t.half().float()


def step_case(holder, change, when):
    def body(use_rk):
        torch.manual_seed(0)
        S, T = lin(), lin().requires_grad_(False)
        opt = torch.optim.SGD(S.parameters(), lr=0.1)
        if holder == "closure":
            lf = lambda m, x: (m(x) - T(x)).pow(2).mean()  # noqa: E731
        elif holder == "dict":
            ctx = {"teacher": T}
            lf = lambda m, x: (m(x) - ctx["teacher"](x)).pow(2).mean()  # noqa: E731
        elif holder == "default_dict":

            def lf(m, x, models={"teacher": T}):  # noqa: B006
                return (m(x) - models["teacher"](x)).pow(2).mean()
        elif holder == "temp_attr":
            T.temp = torch.tensor(1.0, device=DEV)
            lf = lambda m, x: (m(x) - T(x) / T.temp).pow(2).mean()  # noqa: E731
        step = rk.TrainStep(S, lf, opt, backend=BACKEND) if use_rk else None
        losses = []
        for i in range(6):
            if i in when:
                if change == "temp":
                    T.temp = torch.tensor(1.0 + 0.5 * i, device=DEV)
                else:
                    change(T)
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).to(DEV)
            if step is not None:
                loss = step(x)
            else:
                loss = lf(S, x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return [S.weight.detach().clone(), torch.stack(losses)], step

    return body


def cap_case(how, change, when):
    class Student(nn.Module):
        def __init__(self, t):
            super().__init__()
            self.fc = lin()
            if how == "dict":
                self.held = {"teacher": t}
            else:
                self.aux = types.SimpleNamespace(teacher=t)

        def forward(self, x):
            t = self.held["teacher"] if how == "dict" else self.aux.teacher
            return self.fc(x) - t(x)

    def body(use_rk):
        torch.manual_seed(0)
        T = lin().requires_grad_(False)
        m = Student(T)
        opt = torch.optim.SGD(m.fc.parameters(), lr=0.1)
        rec = rk.capture(m, backend=BACKEND, warmup=1) if use_rk else None
        losses = []
        for i in range(6):
            if i in when:
                change(T)
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).to(DEV)
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return [m.fc.weight.detach().clone(), torch.stack(losses)], rec

    return body


CASES = {
    "step_closure_none": step_case("closure", reload, ()),
    "step_closure_data_rebind": step_case("closure", rebind, (1, 2, 3, 4, 5)),
    "step_dict_data_rebind": step_case("dict", rebind, (1, 2, 3, 4, 5)),
    "step_dict_data_rebind_once": step_case("dict", rebind, (3,)),
    "step_dict_assign_load": step_case("dict", reload, (2, 4)),
    "step_default_dict_assign_load": step_case("default_dict", reload, (2,)),
    "step_teacher_temp_attr": step_case("temp_attr", "temp", (2, 3, 4, 5)),
    "step_dict_vector_to_parameters": step_case("dict", v2p, (2, 4)),
    "step_dict_half_float": step_case("dict", half_float, (2, 4)),
    "cap_dict_vector_to_parameters": cap_case("dict", v2p, (2, 4)),
    "cap_dict_data_rebind": cap_case("dict", rebind, (1, 2, 3, 4, 5)),
    "cap_dict_data_rebind_once": cap_case("dict", rebind, (3,)),
    "cap_dict_assign_load": cap_case("dict", reload, (2, 4)),
    "cap_ns_assign_load": cap_case("ns", reload, (2,)),
}

print("torch", torch.__version__, "backend", BACKEND)
only = sys.argv[2:]
for name, body in CASES.items():
    if only and not any(name.startswith(o) for o in only):
        continue
    try:
        (a, _), (b, entry) = body(False), body(True)
        same = [torch.equal(u, v) for u, v in zip(a, b, strict=True)]
        counts = {
            k: v
            for k, v in entry.counts.items()
            if v and k in ("record", "replay", "eager", "rerecord", "retire")
        }
        verdict = "equal" if all(same) else "SILENT"
        if verdict == "SILENT":
            d = (a[1] - b[1]).abs().max().item()
            verdict += f" (loss max diff {d:.3g}, weight equal={same[0]})"
        print(f"{name:34s} {verdict:44s} {counts} {dict(entry.eager_reasons)}", flush=True)
    except Exception as e:
        print(f"{name:34s} {type(e).__name__}: {str(e)[:200]}", flush=True)
