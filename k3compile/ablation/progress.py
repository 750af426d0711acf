"""The study's console: a progress bar for the study and one per running run, messages, the final rich table."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class _Quiet:
    def say(self, *args, **kwargs) -> None:
        pass

    def start(self, key) -> None:
        pass

    def tick(self, key, step: int) -> None:
        pass

    def finish(self, key, result) -> None:
        pass

    def running(self) -> list[str]:
        return []

    def table(self, doc) -> None:
        pass


@contextlib.contextmanager
def display(enabled: bool, study, keys, done: dict) -> Iterator:
    if not enabled:
        yield _Quiet()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)
    total = sum(study.steps[k.variant] for k in keys)
    finished = sum(study.steps[k.variant] for k in keys if k.id in done)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=console) as progress:
        whole = progress.add_task("", total=total, completed=finished)
        bars: dict[str, int] = {}  # the running runs' bars only: queued runs show in the study bar's count
        at: dict[str, int] = {}
        ended = set(done)

        def describe() -> None:
            progress.update(whole, description=f"study: {len(ended)}/{len(keys)} runs done, {len(bars)} running")

        describe()

        class Show:
            def say(self, text: str) -> None:
                progress.console.print(text)

            def start(self, key) -> None:
                if key.id in bars or key.id in ended:
                    return
                bars[key.id] = progress.add_task(key.id, total=study.steps[key.variant])
                at[key.id] = 0
                describe()

            def tick(self, key, step: int) -> None:
                """Advance a run's bar; a run's first tick shows its bar (a worker's run starts when it ticks)."""
                if key.id in ended:
                    return
                self.start(key)
                if at[key.id] == 0 and step > 0:  # a resumed run: its first tick is where it resumes
                    progress.advance(whole, step)
                    progress.update(bars[key.id], completed=step)
                    at[key.id] = step
                    return
                progress.advance(whole, step - at[key.id])
                progress.update(bars[key.id], completed=step)
                at[key.id] = step

            def running(self) -> list[str]:
                """The runs whose bars show now."""
                return list(bars)

            def finish(self, key, result) -> None:
                if key.id in bars:
                    progress.remove_task(bars.pop(key.id))
                ended.add(key.id)
                describe()
                metric = "val loss" if result["task"] == "lm" else "MQAR acc"
                progress.console.print(f"{key.id}: final {metric} {result['final']:.4f}, best {result['best']:.4f}")

            def table(self, doc) -> None:
                from k3compile.ablation.results import table_rows

                header, rows = table_rows(doc)
                t = Table(title=f"ablation results, sorted by {doc['main_metric']}")
                for h in header:
                    t.add_column(h, overflow="fold")
                for row in rows:
                    t.add_row(*row)
                progress.console.print(t)

        yield Show()
