"""Benchmarks: replay against eager (and against CUDA's own graph helpers), step time and memory.

    timing          what every benchmark shares: sizes, a timed arm, interleaved rounds, peak memory
    network         network replay (``rk.capture``) vs eager vs ``make_graphed_callables``
    step            the whole step (``rk.TrainStep``) vs network replay vs a raw whole-step graph
    lightning_step  the same under Lightning's automatic loop (``replaykit.lightning.whole_step``)
    overhead        ``python -m replaykit.testing.bench.overhead``: replaykit's own host time per call

Every arm's end state is compared with eager's bit for bit: a benchmark that trains wrong
measures nothing. Timings are never asserted. The package's names are the network
benchmark's (``bench.run``, ``bench.table`` ...), as the benchmark notebook calls them.
"""

from .network import CHECKED, MARKDOWN_COLUMNS, bench_size, markdown, run, summary, table
from .timing import SIZES, ArmResult, Size, interleave, timed_results

__all__ = [
    "CHECKED",
    "MARKDOWN_COLUMNS",
    "SIZES",
    "ArmResult",
    "Size",
    "bench_size",
    "interleave",
    "markdown",
    "run",
    "summary",
    "table",
    "timed_results",
]
