"""Hugging Face transformers: during a recording, its capture check answers False, so it takes eager's path.

transformers 5.x asks ``is_tracing()`` (``torch.compiler``, ``torch.jit`` or
``is_cuda_stream_capturing()``) before reading a padding mask on the host
(``masking_utils._ignore_causal_mask_sdpa``, ``_ignore_bidirectional_mask_sdpa``): under a
capture it skips the read and builds an explicit mask, where eager, on a batch without
padding, passes no mask and ``is_causal=True`` to SDPA. The two compute differently (a Llama
fine-tune under a whole-step graph ended silently different on the H200). While replaykit
records, ``is_cuda_stream_capturing`` answers False: transformers makes eager's host read,
which :mod:`replaykit.guards.input_reads` answers from the recording's key (the mask's ``.all()`` is a
function of the batch alone), and the recording follows eager's path for that kind of batch.
``torch.compile``/``torch.jit`` tracing is left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import transformers.utils.import_utils as import_utils

from ..verify.contexts import register


def _not_capturing() -> bool:
    return False


@contextmanager
def eager_branches() -> Iterator[None]:
    """transformers sees no capture inside the block (put back after, whatever happens)."""
    original = import_utils.is_cuda_stream_capturing
    import_utils.is_cuda_stream_capturing = _not_capturing
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = original


register("transformers", eager_branches)
