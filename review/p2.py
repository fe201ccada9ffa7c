import sys, copy, torch
from torch import nn
from harness import *

SGDf = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
which = sys.argv[1:]
P = {}
def pat(f): P[f.__name__] = f; return f

@pat
def unfreeze_layer_foreach():
    def setup(replay):
        model = Net(); model.l1.requires_grad_(False)
        opt = SGDf(model)
        return {"model": model, "opt": opt, "step": TrainStep(model, ce, opt, replay=replay)}
    def b(env, i):
        if i == 3: env["model"].l1.requires_grad_(True)
    check("frozen l1 unfrozen mid-training (foreach SGD)", setup, simple_drive(7, b))

@pat
def scaler_load_state():
    def setup(replay):
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        return {"model": model, "opt": opt, "scaler": scaler, "step": TrainStep(model, ce, opt, scaler=scaler, max_norm=1.0, replay=replay)}
    def b(env, i):
        if i == 3:
            sd = env["scaler"].state_dict(); sd["scale"] = 64.0; sd["growth_factor"] = 3.0
            env["scaler"].load_state_dict(sd)
    check("scaler.load_state_dict (scale+growth_factor)", setup, simple_drive(7, b))

@pat
def scaler_unfused():
    def setup(replay):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        return {"model": model, "opt": opt, "scaler": scaler, "step": TrainStep(model, ce, opt, scaler=scaler, replay=replay)}
    check("GradScaler with non-fused SGD", setup, simple_drive(5))

@pat
def scaler_disabled():
    def setup(replay):
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        return {"model": model, "opt": opt, "scaler": scaler, "step": TrainStep(model, ce, opt, scaler=scaler, replay=replay)}
    check("GradScaler(enabled=False) with non-fused SGD", setup, simple_drive(5))

@pat
def scaler_overflow_accum():
    def setup(replay):
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        return {"model": model, "opt": opt, "scaler": scaler, "step": TrainStep(model, ce, opt, scaler=scaler, accumulate=3, precision="bf16-mixed", replay=replay)}
    def drive(env, g):
        for i in range(15):
            x, y = batch(g)
            if i in (7, 11): x[0, 0] = float("inf")
            env["losses"].append(env["step"](x, y))
    check("scaler fused Adam bf16 accumulate=3 with overflows", setup, drive)

@pat
def ema_set_decay():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), fused=True)
        ema = EMA(model, 0.9)
        return {"model": model, "opt": opt, "ema": ema, "step": TrainStep(model, ce, opt, ema=ema, replay=replay)}
    def b(env, i): env["ema"].set_decay(0.9 + 0.01 * i)
    check("EMA set_decay each step", setup, simple_drive(7, b))

@pat
def ema_replace_params():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), fused=True)
        ema = EMA(model, 0.9)
        return {"model": model, "opt": opt, "ema": ema, "step": TrainStep(model, ce, opt, ema=ema, replay=replay)}
    def b(env, i):
        if i == 3:  # reset the EMA to the current weights
            env["ema"].params = [p.detach().clone() for p in env["model"].parameters()]
    check("EMA params list replaced (reset)", setup, simple_drive(7, b))

@pat
def ema_replace_weights():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), fused=True)
        ema = EMA(model, 0.9)
        return {"model": model, "opt": opt, "ema": ema, "step": TrainStep(model, ce, opt, ema=ema, replay=replay)}
    def b(env, i):
        if i == 3:
            w = torch.tensor(0.5)
            env["ema"]._weights = {k: w for k in env["ema"]._weights}; env["ema"].weights = [w for _ in env["ema"].params]
    check("EMA weights tensors replaced", setup, simple_drive(7, b))

@pat
def ema_load():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), fused=True)
        ema = EMA(model, 0.9)
        return {"model": model, "opt": opt, "ema": ema, "step": TrainStep(model, ce, opt, ema=ema, replay=replay)}
    def b(env, i):
        if i == 3:
            for e, p in zip(env["ema"].params, env["model"].parameters()): e.copy_(p)
    check("EMA reset in place (copy_)", setup, simple_drive(7, b))

@pat
def dict_batch():
    def loss(m, b):
        return nn.functional.cross_entropy(m(b["x"]), b["y"])
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); env["losses"].append(env["step"]({"x": x, "y": y}))
    check("dict batch", basic_setup(loss_fn=loss), drive)

@pat
def tuple_batch_float_weight():
    def loss(m, b, w):
        x, y = b
        return nn.functional.cross_entropy(m(x), y) * w
    def drive(env, g):
        for i in range(8):
            x, y = batch(g); env["losses"].append(env["step"]((x, y), 1.0 if i < 4 else 0.5))
    check("tuple batch + float weight arg", basic_setup(loss_fn=loss), drive)

@pat
def int_arg():
    def loss(m, x, y, k):
        return nn.functional.cross_entropy(m(x)[:, :k].contiguous(), y.clamp(max=k - 1))
    def drive(env, g):
        for i in range(8):
            x, y = batch(g); env["losses"].append(env["step"](x, y, 3 + (i % 2)))
    check("int arg changing", basic_setup(loss_fn=loss), drive)

@pat
def same_tensor_twice():
    def loss(m, a, b, y):
        return nn.functional.cross_entropy(m(a) + m(b), y)
    def drive(env, g):
        for i in range(8):
            x, y = batch(g); x2 = torch.randn(6, 8, generator=g)
            if i % 2: env["losses"].append(env["step"](x, x, y))
            else: env["losses"].append(env["step"](x, x2, y))
    check("same tensor passed twice (alternating)", basic_setup(loss_fn=loss), drive)

@pat
def noncontig():
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); x = torch.randn(8, 6, generator=g).t() if i % 2 else x
            env["losses"].append(env["step"](x, y))
    check("non-contiguous inputs alternating", basic_setup(), drive)

@pat
def input_inplace_mod_in_loss():
    def loss(m, x, y):
        x.mul_(2)  # user normalizes the batch in place inside the loss
        return nn.functional.cross_entropy(m(x), y)
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); env["losses"].append(env["step"](x, y)); env["kept"].append(x)
    check("loss_fn mutates its input in place", basic_setup(loss_fn=loss), drive)

@pat
def partial_batch():
    def drive(env, g):
        for i in range(9):
            x, y = batch(g, 6 if i % 3 else 4); env["losses"].append(env["step"](x, y))
    check("partial batches interleaved", basic_setup(), drive)

@pat
def dtype_inputs():
    def loss(m, x, y): return nn.functional.cross_entropy(m(x.float()), y)
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); x = x.double() if i % 2 else x
            env["losses"].append(env["step"](x, y))
    check("input dtype alternating", basic_setup(loss_fn=loss), drive)

if __name__ == "__main__":
  for name in (which or P):
    P[name]()
