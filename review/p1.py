import sys, torch
from torch import nn
from harness import *

SGDf = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
SGDt = lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
which = sys.argv[1:] 
P = {}
def pat(f): P[f.__name__] = f; return f

@pat
def baseline():
    check("baseline sgd fused tensor lr", basic_setup(), simple_drive(6))

@pat
def float_lr_every_step():
    def b(env, i):
        for gr in env["opt"].param_groups: gr["lr"] = 0.05 * (0.9 ** i)
    check("float lr changed each step (budget)", basic_setup(SGDf), simple_drive(14, b))

@pat
def tensor_lr_replaced():
    def b(env, i):
        for gr in env["opt"].param_groups: gr["lr"] = torch.tensor(0.05 * (0.9 ** i))
    check("tensor lr replaced by a new tensor each step", basic_setup(), simple_drive(8, b))

@pat
def tensor_lr_fill():
    def b(env, i):
        for gr in env["opt"].param_groups: gr["lr"].fill_(0.05 * (0.9 ** i))
    check("tensor lr fill_", basic_setup(), simple_drive(8, b))

@pat
def weight_decay_change():
    def b(env, i):
        if i == 3:
            for gr in env["opt"].param_groups: gr["weight_decay"] = 1e-2
    check("weight_decay changed", basic_setup(), simple_drive(7, b))

@pat
def momentum_change():
    def b(env, i):
        if i == 3:
            for gr in env["opt"].param_groups: gr["momentum"] = 0.5
    check("momentum changed", basic_setup(), simple_drive(7, b))

@pat
def adamw_betas_change():
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), fused=True)
    def b(env, i):
        if i == 3:
            for gr in env["opt"].param_groups: gr["betas"] = (0.8, 0.99)
    check("AdamW fused betas changed", basic_setup(opt), simple_drive(7, b))

@pat
def add_param_group():
    def setup(replay):
        model = Net(); extra = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        model.extra = None
        return {"model": model, "opt": opt, "step": TrainStep(model, ce, opt, replay=replay), "x": extra}
    def b(env, i):
        if i == 3:
            env["opt"].add_param_group({"params": list(env["model"].l1.parameters())[:0] or [nn.Parameter(torch.zeros(3))], "lr": torch.tensor(0.01)})
    check("add_param_group (new unrelated param)", setup, simple_drive(7, b))

@pat
def opt_load_state():
    def b(env, i):
        if i == 3:
            import copy
            env["opt"].load_state_dict(copy.deepcopy(env["opt"].state_dict()))
    check("optimizer.load_state_dict", basic_setup(), simple_drive(7, b))

@pat
def submodule_eval():
    def b(env, i):
        if i == 3: env["model"].drop.eval()
        if i == 5: env["model"].bn.eval()
    check("submodule eval() mid-training", basic_setup(), simple_drive(8, b))

@pat
def dropout_p():
    def b(env, i):
        env["model"].drop.p = 0.1 + 0.05 * (i % 3)
    check("dropout p cycling", basic_setup(), simple_drive(9, b))

@pat
def freeze_layer():
    def b(env, i):
        if i == 3: env["model"].l1.requires_grad_(False)
    check("requires_grad_(False) on l1 mid-training", basic_setup(), simple_drive(7, b))

@pat
def freeze_layer_float():
    def b(env, i):
        if i == 3: env["model"].l1.requires_grad_(False)
    check("requires_grad_(False) on l1, sgd float lr", basic_setup(SGDf), simple_drive(7, b))

@pat
def unfreeze_layer():
    def setup(replay):
        model = Net(); model.l1.requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        return {"model": model, "opt": opt, "step": TrainStep(model, ce, opt, replay=replay)}
    def b(env, i):
        if i == 3: env["model"].l1.requires_grad_(True)
    check("frozen l1 unfrozen mid-training", setup, simple_drive(7, b))

@pat
def swap_layer():
    def b(env, i):
        if i == 3:
            torch.manual_seed(5)
            env["model"].drop = nn.Dropout(0.2)
    check("swap a submodule (Dropout -> new Dropout)", basic_setup(), simple_drive(7, b))

@pat
def to_double():
    def b(env, i):
        if i == 3: env["model"].double()
    def drive(env, g):
        for i in range(7):
            x, y = batch(g)
            if i > 3: x = x.double()
            env["losses"].append(env["step"](x, y)); b(env, i)
    check("model.double() mid-training", basic_setup(SGDf), drive)

if __name__ == "__main__":
  for name in (which or P):
    P[name]()
