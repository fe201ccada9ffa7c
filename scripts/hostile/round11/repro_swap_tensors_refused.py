# U1 (not silent, a break): torch.utils.swap_tensors / the swap conversion path on a captured model's
# parameter raises torch's RuntimeError (replaykit's guard holds weak references to parameters)
import torch
from torch import nn

import replaykit as rk

for use_rk in (False, True):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    rec = rk.capture(m, backend="emulated", warmup=1) if use_rk else None
    m(torch.randn(5, 6)).sum().backward()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.half().float()
        print("rk" if use_rk else "eager", "ok")
    except Exception as e:
        print("rk" if use_rk else "eager", type(e).__name__, e)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
