"""Progress reporting: the no-op base that long steps report to, and a rich bar on stderr."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn
from rich.progress import Progress as Bar
from rich.progress import TextColumn, TimeElapsedColumn, TimeRemainingColumn


class Progress:
    """What `measure` reports to; the no-op base. `rich_progress` draws a bar with an ETA."""

    def start(self, total: int) -> None: ...

    def advance(self, what: str) -> None: ...


class rich_progress(Progress):
    """A rich progress bar on stderr (what is measured, done/total, ETA); silent when
    `enabled` is false. Use as a context manager."""

    def __init__(self, enabled: bool = True, title: str = "measuring") -> None:
        self.enabled, self.title, self._bar, self._task = enabled, title, None, None

    def __enter__(self) -> "rich_progress":
        if self.enabled:
            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def start(self, total: int) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task(self.title, total=max(total, 1))
            if total == 0:
                self._bar.update(self._task, completed=1, description=f"{self.title}: all cached")

    def advance(self, what: str) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1, description=f"{self.title}: {what}")
