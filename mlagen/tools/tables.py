"""Text tables, without torch: a rich table of plain text cells for the terminal and a GitHub
markdown table. The CLI's commands that need no GPU (list, show, check) and the bench, tune and
fuzz reports (`report`) draw their tables with these."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.table import Table
from rich.text import Text


def text_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str | Text]],
               red: Callable[[str, str], bool] = lambda column, cell: False, caption: str | None = None,
               right: Callable[[str], bool] = lambda column: False) -> Table:
    """A rich table of plain text cells (never read as markup); red(column, cell) marks a cell red
    and right(column) right-aligns a column. A cell given as a rich Text keeps its own style.
    Columns fold a cell too long for them, never cut it."""
    table = Table(title=title, caption=caption, caption_justify="left")
    for col in columns:
        table.add_column(col, justify="right" if right(col) else "left", overflow="fold")
    for row in rows:
        table.add_row(*[cell if isinstance(cell, Text) else Text(cell, style="red" if red(col, cell) else "")
                        for col, cell in zip(columns, row, strict=True)])
    return table


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub markdown table, as lines: a '|' in a cell is escaped, a line break becomes a space."""
    def cells(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |"
    return [cells(columns), "|" + "---|" * len(columns), *(cells(r) for r in rows)]
