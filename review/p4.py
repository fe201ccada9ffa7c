import sys, torch
from torch import nn
from harness import *

which = sys.argv[1:]
P = {}
def pat(f): P[f.__name__] = f; return f
SGDf = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

def acc_drive(n, between):
    def drive(env, g):
        for i in range(n):
            x, y = batch(g)
            env["losses"].append(env["step"](x, y))
            between(env, i)
    return drive

for k in (1, 2, 3, 4):
    def _f(k=k):
        def b(env, i): env["kept"].append(env["model"].head.weight.grad)
        check(f"accumulate={k}, user keeps p.grad refs after every call", basic_setup(accumulate=k), acc_drive(4 * k + 1, b))
    P[f"acc_keep_{k}"] = _f

@pat
def acc_keep_detach():
    def b(env, i):
        g = env["model"].head.weight.grad
        if g is not None: env["kept"].append(g.detach())
    check("accumulate=2, user keeps p.grad.detach()", basic_setup(accumulate=2), acc_drive(9, b))

@pat
def acc_keep_view():
    def b(env, i):
        g = env["model"].head.weight.grad
        if g is not None: env["kept"].append(g.view(-1))
    check("accumulate=2, user keeps p.grad.view(-1)", basic_setup(accumulate=2), acc_drive(9, b))

@pat
def acc_keep_data():
    def b(env, i):
        g = env["model"].head.weight.grad
        if g is not None: env["kept"].append(g.data)
    check("accumulate=2, user keeps p.grad.data", basic_setup(accumulate=2), acc_drive(9, b))

@pat
def acc_keep_dict_of_grads():
    def b(env, i):
        if i % 2 == 0: env["kept"].extend([p.grad for p in env["model"].parameters()])
    check("accumulate=2, user keeps [p.grad for p] list", basic_setup(accumulate=2), acc_drive(9, b))

@pat
def acc_grad_noise_inplace():
    def b(env, i):
        if i % 3 != 2:
            for p in env["model"].parameters(): p.grad.add_(torch.randn_like(p.grad) * 1e-3)
    check("accumulate=3, grad noise added in place between micro-batches", basic_setup(accumulate=3), acc_drive(12, b))

@pat
def acc_manual_clip_between():
    def b(env, i):
        if i % 2 == 0:
            torch.nn.utils.clip_grad_norm_(env["model"].parameters(), 0.1)
    check("accumulate=2, clip_grad_norm_ between micro-batches", basic_setup(accumulate=2), acc_drive(10, b))

@pat
def acc_grad_replace():
    def b(env, i):
        if i % 2 == 0:
            for p in env["model"].parameters(): p.grad = p.grad * 0.5
    check("accumulate=2, p.grad = p.grad * 0.5 between micro-batches", basic_setup(accumulate=2), acc_drive(12, b))

@pat
def acc_user_zero_grad():
    def b(env, i):
        if i == 4: env["opt"].zero_grad()
    check("accumulate=2, user calls opt.zero_grad() after a first micro-batch", basic_setup(accumulate=2), acc_drive(10, b))

@pat
def acc_user_zero_grad_false():
    def b(env, i):
        if i % 2 == 0: env["opt"].zero_grad(set_to_none=False)
    check("accumulate=2, user zero_grad(set_to_none=False) after each first", basic_setup(accumulate=2), acc_drive(10, b))

@pat
def acc_partial_last():
    def drive(env, g):
        for i in range(12):
            x, y = batch(g, 4 if i % 4 == 3 else 6)
            env["losses"].append(env["step"](x, y))
    check("accumulate=4, partial last micro-batch each step", basic_setup(accumulate=4), drive)

@pat
def sched_steplr_float():
    def setup(replay):
        env = basic_setup(SGDf)(replay); env["sched"] = torch.optim.lr_scheduler.StepLR(env["opt"], 2, 0.5); return env
    check("StepLR with float lr", setup, simple_drive(10, lambda e, i: e["sched"].step()))

@pat
def sched_onecycle_tensor():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
        return {"model": model, "opt": opt, "sched": sched, "step": TrainStep(model, ce, opt, replay=replay)}
    check("OneCycleLR with tensor lr (cycles momentum floats)", setup, simple_drive(12, lambda e, i: e["sched"].step()))

@pat
def sched_onecycle_adamw():
    def setup(replay):
        model = Net(); opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
        return {"model": model, "opt": opt, "sched": sched, "step": TrainStep(model, ce, opt, replay=replay)}
    check("OneCycleLR AdamW fused tensor lr (cycles betas)", setup, simple_drive(12, lambda e, i: e["sched"].step()))

@pat
def sched_lambda_tensor():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        return {"model": model, "opt": opt, "sched": sched, "step": TrainStep(model, ce, opt, replay=replay)}
    check("LambdaLR tensor lr", setup, simple_drive(10, lambda e, i: e["sched"].step()))

@pat
def sched_plateau_float():
    def setup(replay):
        env = basic_setup(SGDf)(replay); env["sched"] = torch.optim.lr_scheduler.ReduceLROnPlateau(env["opt"], patience=0, factor=0.5); return env
    check("ReduceLROnPlateau float lr (metric=returned loss)", setup, simple_drive(10, lambda e, i: e["sched"].step(e["losses"][-1])))

@pat
def sched_plateau_tensor():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        return {"model": model, "opt": opt, "sched": sched, "step": TrainStep(model, ce, opt, replay=replay)}
    check("ReduceLROnPlateau tensor lr", setup, simple_drive(10, lambda e, i: e["sched"].step(e["losses"][-1])))

@pat
def sched_cosine_warm_restarts():
    def setup(replay):
        model = Net(); opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3)
        return {"model": model, "opt": opt, "sched": sched, "step": TrainStep(model, ce, opt, max_norm=0.5, replay=replay)}
    check("CosineAnnealingWarmRestarts AdamW fused tensor lr + clip", setup, simple_drive(10, lambda e, i: e["sched"].step()))

if __name__ == "__main__":
  for name in (which or P):
    P[name]()
