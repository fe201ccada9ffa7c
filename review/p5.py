import sys, copy, pickle, io, threading, torch
from torch import nn
from harness import *

which = sys.argv[1:]
P = {}
def pat(f): P[f.__name__] = f; return f

def optcase(name, fn, **kw):
    def f():
        check(name, basic_setup(fn, **kw), simple_drive(6))
    P["opt_" + name] = f

optcase("SGD foreach float lr nesterov wd", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=True))
optcase("SGD fused float lr", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=True))
optcase("SGD no momentum foreach tensor lr", lambda m: torch.optim.SGD(m.parameters(), lr=torch.tensor(0.05)))
optcase("Adam fused float lr", lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, fused=True))
optcase("AdamW fused amsgrad", lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), fused=True, amsgrad=True))
optcase("Adam capturable foreach (CPU)", lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, capturable=True, foreach=True))
optcase("Adam plain", lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))
optcase("RMSprop", lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9))
optcase("RMSprop capturable", lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9, capturable=True))
optcase("Adagrad", lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2))
optcase("Adagrad fused", lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2, fused=True))
optcase("Adamax capturable", lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2, capturable=True))
optcase("NAdam capturable", lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2, capturable=True))

def clipcase(name, max_norm, **kw):
    def f():
        check(name, basic_setup(max_norm=max_norm, **kw), simple_drive(6))
    P["clip_" + name] = f
clipcase("max_norm=0.5", 0.5)
clipcase("max_norm=inf", float("inf"))
clipcase("max_norm=0.0", 0.0)
clipcase("max_norm int 1", 1)

@pat
def clip_changed():
    check("step.max_norm changed mid-run", basic_setup(max_norm=1.0), simple_drive(6, lambda e, i: setattr(e["step"], "max_norm", 0.1 if i >= 2 else 1.0)))

@pat
def clip_nonfinite():
    def drive(env, g):
        for i in range(6):
            x, y = batch(g)
            if i == 3: x[0, 0] = float("nan")
            env["losses"].append(env["step"](x, y))
    check("clip with a NaN batch at step 3", basic_setup(max_norm=1.0), drive)

@pat
def scaler_fused_sgd_growth():
    def setup(replay):
        model = Net(); opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
        return {"model": model, "opt": opt, "scaler": scaler, "step": TrainStep(model, ce, opt, scaler=scaler, max_norm=1.0, precision="16-mixed", replay=replay)}
    def drive(env, g):
        for i in range(8):
            x, y = batch(g)
            if i == 4: x[0, 0] = float("inf")
            env["losses"].append(env["step"](x, y))
    check("GradScaler + fused SGD fp16 autocast, clip, overflow", setup, drive)

@pat
def retain_losses():
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); env["losses"].append(env["step"](x, y))
        env["extra"] = {"sum": torch.stack(env["losses"]).sum()}
    check("retain returned losses, stack at the end", basic_setup(), drive)

@pat
def under_no_grad():
    def drive(env, g):
        for i in range(4):
            x, y = batch(g)
            if i == 2:
                with torch.no_grad():
                    env["losses"].append(env["step"](x, y))
            else:
                env["losses"].append(env["step"](x, y))
    check("a step called under torch.no_grad()", basic_setup(), drive)

@pat
def under_inference_mode():
    def drive(env, g):
        for i in range(4):
            x, y = batch(g)
            if i == 2:
                with torch.inference_mode():
                    env["losses"].append(env["step"](x, y))
            else:
                env["losses"].append(env["step"](x, y))
    check("a step called under torch.inference_mode()", basic_setup(), drive)

@pat
def exception_at_step():
    def drive(env, g):
        for i in range(7):
            x, y = batch(g)
            try:
                if i == 4:
                    env["losses"].append(env["step"](x, y.unsqueeze(1)))  # shape error in loss
                else:
                    env["losses"].append(env["step"](x, y))
            except RuntimeError:
                env["losses"].append(None)
    check("RuntimeError (bad target) at call 4, user catches and continues", basic_setup(), drive)

@pat
def keyboard_interrupt_replay():
    state = {"n": 0}
    def loss(m, x, y):
        state["n"] += 1
        if state["n"] == 5: raise KeyboardInterrupt
        return ce(m, x, y)
    def setup(replay):
        state["n"] = 0; return basic_setup(loss_fn=loss, accumulate=2)(replay)
    def drive(env, g):
        for i in range(9):
            x, y = batch(g)
            try: env["losses"].append(env["step"](x, y))
            except KeyboardInterrupt: env["losses"].append(None)
    check("KeyboardInterrupt from loss_fn on its 5th Python call (accumulate=2)", setup, drive)

@pat
def keyboard_interrupt_during_record():
    state = {"n": 0}
    def loss(m, x, y):
        state["n"] += 1
        l = ce(m, x, y)
        if state["n"] == 2: raise KeyboardInterrupt  # the first recording call
        return l
    def setup(replay):
        state["n"] = 0; return basic_setup(loss_fn=loss)(replay)
    def drive(env, g):
        for i in range(6):
            x, y = batch(g)
            try: env["losses"].append(env["step"](x, y))
            except KeyboardInterrupt: env["losses"].append(None)
    check("KeyboardInterrupt during the recording call, user continues", setup, drive)

@pat
def value_error_during_record():
    state = {"n": 0}
    def loss(m, x, y):
        state["n"] += 1
        l = ce(m, x, y)
        if state["n"] == 2: raise ValueError("bad batch")
        return l
    def setup(replay):
        state["n"] = 0; return basic_setup(loss_fn=loss)(replay)
    def drive(env, g):
        for i in range(6):
            x, y = batch(g)
            try: env["losses"].append(env["step"](x, y))
            except ValueError: env["losses"].append(None)
        env["extra"] = {"n": torch.tensor(state["n"])}
    check("ValueError from loss_fn during the recording call, user continues", setup, drive)

@pat
def deepcopy_model_mid():
    def b(env, i):
        if i == 3: env["copy"] = copy.deepcopy(env["model"]); env["kept"] += list(env["copy"].parameters())
    check("deepcopy(model) mid-training (EMA-style snapshot)", basic_setup(), simple_drive(7, b))

@pat
def pickle_model_mid():
    def b(env, i):
        if i == 3:
            buf = io.BytesIO(); torch.save(env["model"], buf); buf.seek(0)
            m2 = torch.load(buf, weights_only=False); env["kept"] += list(m2.state_dict().values())
    check("torch.save(model) whole-module pickle mid-training", basic_setup(), simple_drive(7, b))

@pat
def state_dict_load_mid():
    def b(env, i):
        if i == 3:
            sd = copy.deepcopy(env["model"].state_dict()); env["model"].load_state_dict(sd)
    check("model.load_state_dict (copy) mid-training", basic_setup(), simple_drive(7, b))

@pat
def threads():
    def drive(env, g):
        x, y = batch(g); env["losses"].append(env["step"](x, y))
        x, y = batch(g); env["losses"].append(env["step"](x, y))
        def work():
            for i in range(3):
                xx, yy = batch(g); env["losses"].append(env["step"](xx, yy))
        t = threading.Thread(target=work); t.start(); t.join()
        x, y = batch(g); env["losses"].append(env["step"](x, y))
    check("calls from another thread after main-thread recording", basic_setup(), drive)

@pat
def released_then_called():
    def b(env, i):
        if i == 3: env["step"].release()
    check("release() then keep calling", basic_setup(), simple_drive(7, b))

class MHA(nn.Module):
    def __init__(self):
        super().__init__(); self.att = nn.MultiheadAttention(8, 2, batch_first=True); self.head = nn.Linear(8, 4)
    def forward(self, q, k):
        return self.head(self.att(q, k, k, need_weights=False)[0].mean(1))

@pat
def mha_same_tensor():
    def loss(m, q, k, y): return nn.functional.cross_entropy(m(q, k), y)
    def drive(env, g):
        for i in range(6):
            x = torch.randn(6, 5, 8, generator=g); y = torch.randint(0, 4, (6,), generator=g)
            env["losses"].append(env["step"](x, x, y))
    check("MHA self-attention step(x, x, y) (q is k)", basic_setup(model_fn=MHA, loss_fn=loss), drive)

@pat
def is_branch():
    def loss(m, a, b, y):
        return ce(m, a, y) if a is b else ce(m, a, y) * 2
    def drive(env, g):
        for i in range(6):
            x, y = batch(g); env["losses"].append(env["step"](x, x, y))
    check("loss_fn branches on `a is b`, step(x, x, y)", basic_setup(loss_fn=loss), drive)

@pat
def whole_model_eval_train():
    def b(env, i):
        env["model"].train(i % 2 == 0)
    check("model.eval()/train() alternating (eval steps still train)", basic_setup(), simple_drive(8, b))

if __name__ == "__main__":
  for name in (which or P):
    P[name]()
