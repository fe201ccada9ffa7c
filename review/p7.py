import sys, torch
from torch import nn
from harness import *
P = {}
def pat(f): P[f.__name__] = f; return f

@pat
def reset_momentum_by_assignment():
    def b(env, i):
        if i == 3:
            opt = env["opt"]
            for p in opt.param_groups[0]["params"]: opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    check("momentum buffers reset by assignment (opt.state[p][k] = zeros)", basic_setup(), simple_drive(7, b))

@pat
def reset_adam_moments_by_assignment():
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2), fused=True)
    def b(env, i):
        if i == 3:
            o = env["opt"]
            for p in o.param_groups[0]["params"]:
                o.state[p]["exp_avg"] = torch.zeros_like(p); o.state[p]["exp_avg_sq"] = torch.zeros_like(p)
    check("AdamW moments reset by assignment", basic_setup(opt), simple_drive(7, b))

@pat
def reset_momentum_inplace():
    def b(env, i):
        if i == 3:
            opt = env["opt"]
            for p in opt.param_groups[0]["params"]: opt.state[p]["momentum_buffer"].zero_()
    check("momentum buffers reset in place", basic_setup(), simple_drive(7, b))

@pat
def param_data_assign():
    def b(env, i):
        if i == 3: env["model"].head.weight.data = env["model"].head.weight.data.clone() * 0.5
    check("param.data = new tensor (re-init head)", basic_setup(), simple_drive(7, b))

@pat
def param_reinit_inplace():
    def b(env, i):
        if i == 3: nn.init.zeros_(env["model"].head.bias)
    check("nn.init in place on a parameter", basic_setup(), simple_drive(7, b))

@pat
def lr_group_lr_tensor_to_float():
    def b(env, i):
        if i == 3:
            for gr in env["opt"].param_groups: gr["lr"] = 0.01
    check("tensor lr replaced by a float (fused SGD)", basic_setup(), simple_drive(7, b))

@pat
def grad_hook_added():
    def b(env, i):
        if i == 3: env["model"].head.weight.register_hook(lambda g: g * 0.5)
    check("gradient hook registered on one param mid-training", basic_setup(), simple_drive(7, b))

@pat
def forward_hook_added():
    def b(env, i):
        if i == 3: env["model"].l1.register_forward_hook(lambda m, a, o: o * 0.5)
    check("forward hook on a submodule mid-training", basic_setup(), simple_drive(7, b))

@pat
def opt_hook_added():
    def b(env, i):
        if i == 3: env["opt"].register_step_post_hook(lambda o, a, k: None)
    check("optimizer step post hook mid-training", basic_setup(), simple_drive(7, b))

@pat
def post_accumulate_hook():
    def b(env, i):
        if i == 3: env["model"].head.weight.register_post_accumulate_grad_hook(lambda p: (p.grad.mul_(0.5), None)[1])
    check("post-accumulate-grad hook on one param mid-training", basic_setup(), simple_drive(7, b))

if __name__ == "__main__":
  for name in (sys.argv[1:] or P):
    P[name]()
