import sys, copy, torch
from torch import nn
from harness import *

which = sys.argv[1:]
P = {}
def pat(f): P[f.__name__] = f; return f

class Toggle(Net):
    def __init__(self):
        super().__init__(); self.task = 0; self.head2 = nn.Linear(16, 4)
    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.l1(x))))
        out = self.head(h) if self.task == 0 else self.head2(h)
        self.task = 1 - self.task  # round-robin over two heads
        return out

@pat
def forward_toggles_attr():
    check("forward toggles a module attribute (round-robin heads)", basic_setup(model_fn=Toggle), simple_drive(8))

class Aux(Net):
    def forward(self, x):
        h = torch.relu(self.bn(self.l1(x)))
        self.aux_loss = h.pow(2).mean()
        return self.head(self.drop(h))

@pat
def aux_loss_on_module():
    def loss(m, x, y): return nn.functional.cross_entropy(m(x), y) + 0.1 * m.aux_loss
    def b(env, i): env["kept"].append(env["model"].aux_loss.detach().clone())
    check("aux loss stored on the module, read by loss_fn and logged", basic_setup(loss_fn=loss), simple_drive(8, b))

@pat
def closure_weight():
    cfg = {"w": 1.0}
    def loss(m, x, y): return nn.functional.cross_entropy(m(x), y) * cfg["w"]
    def b(env, i):
        cfg["w"] = 1.0 if i < 3 else 0.5
    def setup(replay):
        cfg["w"] = 1.0
        return basic_setup(loss_fn=loss)(replay)
    check("loss_fn reads a closure dict weight changed at step 3 (documented known limit)", setup, simple_drive(7, b))

@pat
def loss_reads_module_attr():
    def loss(m, x, y): return nn.functional.cross_entropy(m(x), y, label_smoothing=m.smooth)
    def setup(replay):
        env = basic_setup(loss_fn=loss)(replay); env["model"].smooth = 0.0; return env
    def b(env, i): env["model"].smooth = 0.1 * (i // 2)
    check("loss_fn reads module attribute (label smoothing annealed)", setup, simple_drive(8, b))

@pat
def loss_python_counter_item():
    calls = [0]
    def loss(m, x, y):
        calls[0] += 1
        l = nn.functional.cross_entropy(m(x), y)
        return l * 2 if l.item() > 100 else l
    def setup(replay):
        calls[0] = 0
        return basic_setup(loss_fn=loss)(replay)
    def drive(env, g):
        simple_drive(5)(env, g)
        env["extra"] = {"calls": torch.tensor(calls[0])}
    check("loss_fn: Python counter + .item() branch (capture fails)", setup, drive)

@pat
def loss_value_control_flow_tensor():
    def loss(m, x, y):
        l = nn.functional.cross_entropy(m(x), y)
        return torch.where(l > 1.0, l * 2, l)
    check("loss_fn: value control flow via torch.where", basic_setup(loss_fn=loss), simple_drive(6))

@pat
def loss_if_tensor():
    def loss(m, x, y):
        l = nn.functional.cross_entropy(m(x), y)
        if l > 1.3: return l * 2
        return l
    check("loss_fn: Python if on a tensor", basic_setup(loss_fn=loss), simple_drive(6))

@pat
def randn_in_loss():
    def loss(m, x, y):
        return nn.functional.cross_entropy(m(x + 0.1 * torch.randn_like(x)), y) + torch.rand(()) * 0
    check("torch.randn_like/rand in loss (default generator)", basic_setup(loss_fn=loss), simple_drive(6))

@pat
def private_gen_in_loss():
    gen = torch.Generator().manual_seed(3)
    def loss(m, x, y):
        return nn.functional.cross_entropy(m(x + 0.1 * torch.randn(x.shape, generator=gen)), y)
    def setup(replay):
        gen.manual_seed(3); return basic_setup(loss_fn=loss)(replay)
    check("private generator in loss", setup, simple_drive(6))

@pat
def input_requires_grad():
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); x.requires_grad_(True)
            env["losses"].append(env["step"](x, y)); env["kept"].append(x.grad)
    check("input requires grad; user reads x.grad (saliency)", basic_setup(), drive)

@pat
def python_log_list():
    log = []
    def loss(m, x, y):
        l = nn.functional.cross_entropy(m(x), y); log.append(l.detach()); return l
    def setup(replay):
        log.clear(); return basic_setup(loss_fn=loss)(replay)
    def drive(env, g):
        simple_drive(6)(env, g); env["kept"] = list(log)
    check("loss_fn appends loss.detach() to a Python list", setup, drive)

@pat
def extra_param_in_loss():
    temp = {}
    def loss(m, x, y): return nn.functional.cross_entropy(m(x) / temp["t"], y)
    def setup(replay):
        model = Net(); temp["t"] = nn.Parameter(torch.tensor(1.0))
        opt = torch.optim.SGD([*model.parameters(), temp["t"]], lr=torch.tensor(0.05), momentum=0.9, fused=True)
        return {"model": model, "opt": opt, "step": TrainStep(model, loss, opt, replay=replay), "t": temp["t"]}
    def drive(env, g):
        simple_drive(6)(env, g); env["kept"] = [env["t"], env["t"].grad]
    check("learnable temperature in loss (optimizer param, not model)", setup, drive)

@pat
def param_not_in_opt():
    def setup(replay):
        model = Net()
        opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("head")], lr=torch.tensor(0.05), momentum=0.9, fused=True)
        return {"model": model, "opt": opt, "step": TrainStep(model, ce, opt, replay=replay)}
    check("head params require grad but not in optimizer (grads accumulate)", setup, simple_drive(6))

@pat
def frozen_params():
    def setup(replay):
        model = Net(); model.l1.requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=torch.tensor(0.05), momentum=0.9, fused=True)
        return {"model": model, "opt": opt, "step": TrainStep(model, ce, opt, replay=replay)}
    check("frozen l1 from the start, not in optimizer", setup, simple_drive(6))

class Tied(nn.Module):
    def __init__(self):
        super().__init__(); self.emb = nn.Embedding(10, 8); self.l = nn.Linear(8, 8); self.out = nn.Linear(8, 10, bias=False); self.out.weight = self.emb.weight
    def forward(self, t): return self.out(torch.tanh(self.l(self.emb(t))))

@pat
def tied_weights():
    def loss(m, t, y): return nn.functional.cross_entropy(m(t), y)
    def drive(env, g):
        for i in range(6):
            t = torch.randint(0, 10, (6,), generator=g); y = torch.randint(0, 10, (6,), generator=g)
            env["losses"].append(env["step"](t, y))
    check("tied embedding/output weights", basic_setup(model_fn=Tied, loss_fn=loss), drive)

class SparseEmb(nn.Module):
    def __init__(self):
        super().__init__(); self.emb = nn.Embedding(10, 8, sparse=True); self.l = nn.Linear(8, 10)
    def forward(self, t): return self.l(self.emb(t))

@pat
def sparse_emb():
    def loss(m, t, y): return nn.functional.cross_entropy(m(t), y)
    def drive(env, g):
        for i in range(6):
            t = torch.randint(0, 10, (6,), generator=g); y = torch.randint(0, 10, (6,), generator=g)
            env["losses"].append(env["step"](t, y))
    check("nn.Embedding(sparse=True), SGD float lr", basic_setup(opt_fn=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), model_fn=SparseEmb, loss_fn=loss), drive)

@pat
def bn_momentum_none():
    def mf():
        m = Net(); m.bn.momentum = None; return m
    check("BatchNorm momentum=None", basic_setup(model_fn=mf), simple_drive(5))

if __name__ == "__main__":
  for name in (which or P):
    P[name]()
