import torch
from harness import *
from p3 import Toggle
SGDf = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
check("forward toggles a module attribute (round-robin heads), warmup=2", basic_setup(SGDf, model_fn=Toggle, warmup=2), simple_drive(10))
