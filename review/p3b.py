import sys, torch
from torch import nn
from harness import *
from p3 import Toggle, Aux
SGDf = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
check("forward toggles a module attribute (round-robin heads), foreach SGD", basic_setup(SGDf, model_fn=Toggle), simple_drive(8))
def loss(m, x, y): return nn.functional.cross_entropy(m(x), y) + 0.1 * m.aux_loss
def b(env, i): env["kept"].append(env["model"].aux_loss.detach().clone())
check("aux loss stored on the module, read by loss_fn and logged", basic_setup(model_fn=Aux, loss_fn=loss), simple_drive(8, b))
def b2(env, i): env["kept"].append(env["model"].aux_loss)
check("aux loss stored on the module, the tensor kept by the user", basic_setup(model_fn=Aux, loss_fn=loss), simple_drive(8, b2))
