"""Cases run one by one under an optional progress bar: the parity and zoo matrices' drivers.

Each result is yielded as it comes, so a notebook can render rows while later cases still run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

Case = TypeVar("Case")
Result = TypeVar("Result")


def run_each(
    cases: list[Case],
    run: Callable[[Case], Result],
    desc: str,
    progress: bool,
    postfix: Callable[[Case, Result], str],
) -> Iterator[Result]:
    """``run(case)`` for each case in order, yielding each result; with ``progress`` a tqdm bar
    (``desc``) shows ``postfix(case, result)`` after each."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cases), desc=desc, unit="case")
    try:
        for case in cases:
            result = run(case)
            if bar is not None:
                bar.set_postfix_str(postfix(case, result))
                bar.update()
            yield result
    finally:
        if bar is not None:
            bar.close()
