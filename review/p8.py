import sys, copy, io, torch
from torch import nn
from harness import *
P = {}
def pat(f): P[f.__name__] = f; return f

@pat
def opt_checkpoint_roundtrip():
    def b(env, i):
        if i == 3:
            buf = io.BytesIO(); torch.save({"opt": env["opt"].state_dict(), "model": env["model"].state_dict()}, buf); buf.seek(0)
            ck = torch.load(buf, weights_only=False)
            env["kept"] += [v for v in ck["model"].values()] + [t for s in ck["opt"]["state"].values() for t in s.values()]
            env["extra"] = {"c": torch.tensor(float(len(copy.deepcopy(env["opt"]).state)))}
    check("torch.save(opt.state_dict()) + deepcopy(opt) mid-training (no load)", basic_setup(), simple_drive(7, b))

@pat
def resume_load_opt_and_model():
    def b(env, i):
        if i == 3:
            sd_m = copy.deepcopy(env["model"].state_dict()); sd_o = copy.deepcopy(env["opt"].state_dict())
            env["model"].load_state_dict(sd_m); env["opt"].load_state_dict(sd_o)
    check("resume: model.load_state_dict + opt.load_state_dict mid-run", basic_setup(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)), simple_drive(7, b))

@pat
def loss_keeps_graph_in_list():
    graphs = []
    def loss(m, x, y):
        l = ce(m, x, y); graphs.append(l); return l
    def setup(replay):
        graphs.clear(); return basic_setup(loss_fn=loss)(replay)
    def drive(env, g):
        simple_drive(5)(env, g); env["extra"] = {"n": torch.tensor(len(graphs))}
    check("loss_fn keeps the loss (with its graph) in an outside list", setup, drive)

@pat
def grad_accum_manual_params_subset_frozen_in_opt():
    def setup(replay):
        model = Net(); model.bn.requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9, fused=True)
        return {"model": model, "opt": opt, "step": TrainStep(model, ce, opt, accumulate=2, max_norm=0.5, replay=replay)}
    check("frozen BN affine params inside the optimizer, accumulate=2, clip", setup, simple_drive(8))

if __name__ == "__main__":
  for name in (sys.argv[1:] or P):
    P[name]()
