"""What the notebook build scripts share: collect cells, write an output-free .ipynb under lessons/."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]


class NotebookBuilder:
    def __init__(self) -> None:
        self.cells = []

    def md(self, text: str) -> None:
        self._add(new_markdown_cell(text.strip()))

    def code(self, text: str) -> None:
        self._add(new_code_cell(text.strip()))

    def _add(self, cell) -> None:
        cell.id = f"cell-{len(self.cells):03d}"    # fixed ids: a rebuild changes only what was edited
        self.cells.append(cell)

    def write(self, relative_path: str) -> Path:
        """Write the notebook (no outputs) to ``ROOT / relative_path`` and say so."""
        out = ROOT / relative_path
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(new_notebook(cells=self.cells, metadata={
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        }), out)
        print(f"wrote {relative_path}")
        return out
