import torch
from harness import *
def b(env, i):
    if i == 4: env["model"].l1.requires_grad_(False)
check("accumulate=2, l1 frozen between first and last micro-batch", basic_setup(lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), accumulate=2, max_norm=1.0), simple_drive(10, b))
