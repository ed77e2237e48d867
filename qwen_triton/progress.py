"""Progress of long work (loading, making checkpoints, warm-up) on stderr: a counter rewritten in place on
a terminal, and only the final count where stderr is a file or a pipe."""

from __future__ import annotations

import sys
from collections.abc import Callable


def progress_printer(label: str) -> Callable[[int, int], None]:
    def report(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\r{label}: {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif done == total:
            print(f"{label}: {done}/{total}", file=sys.stderr, flush=True)
    return report
