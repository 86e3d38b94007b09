"""What ``branchbox image build`` shows while the server builds: one line per step.

A rich progress display: the step being built with a spinner and its last output
line; steps taken from the cache say so; a failing step's output is printed by
the caller from the error (which carries its end).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn


class BuildProgress:
    """``on_event`` for ``Sandbox.build_image``, drawing on ``console`` (stderr)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 BarColumn(), MofNCompleteColumn(), console=console,
                                 transient=False)
        self.task = None
        self.step = ""

    def __enter__(self) -> BuildProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def on_event(self, event: dict) -> None:
        if event.get("type") == "step":
            if self.task is None:
                self.task = self.progress.add_task("", total=event["total"])
            else:
                self.progress.advance(self.task)
            self.step = f"step {event['index']}/{event['total']}: {event['text']}"
            cached = " [dim](cached)[/dim]" if event.get("cached") else ""
            self.console.print(f"[bold]{escape(self.step)}[/bold]{cached}")
            self.progress.update(self.task, description=escape(event["text"][:60]))
        elif event.get("type") == "output" and self.task is not None:
            for line in str(event.get("data", "")).splitlines():
                self.console.print(f"[dim]  {escape(line)}[/dim]")

    def done(self) -> None:
        if self.task is not None:
            self.progress.advance(self.task)
