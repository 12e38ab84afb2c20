"""Progress on a terminal: tqdm bars per stack and per layer when stderr is a TTY, plain lines otherwise."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled

    @contextlib.contextmanager
    def bar(self, total: int, desc: str, leave: bool = True) -> Iterator:
        if not self.enabled or total <= 0:
            yield _NoBar()
            return
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, leave=leave, file=self.stream, dynamic_ncols=True, unit="it") as bar:
            yield bar

    def log(self, message: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)
