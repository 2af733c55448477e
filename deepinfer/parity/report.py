"""A parity report: rows for a terminal table and for `--json`, plus a one-line verdict.

Must not: compute comparisons (compare.py) or run models (the command modules)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Report:
    command: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""
    defects: list[str] = field(default_factory=list)  # what the command judged a defect (empty: none)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.defects

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "verdict": self.verdict, "defects": self.defects, "meta": self.meta,
                "rows": self.rows}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False, indent=2, default=str) + "\n",
                              encoding="utf-8")

    def table(self, limit: int | None = None) -> str:
        def fmt(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:.6g}"
            return str(v)

        rows = self.rows if limit is None else self.rows[:limit]
        cells = [[fmt(r.get(c, "")) for c in self.columns] for r in rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(self.columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
        if limit is not None and len(self.rows) > limit:
            lines.append(f"... {len(self.rows) - limit} more rows (see --json)")
        lines.append(f"verdict: {self.verdict}")
        lines += [f"  defect: {d}" for d in self.defects]
        return "\n".join(lines)
