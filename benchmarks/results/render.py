"""Print the benchmark result files in this folder as Markdown tables, with the command, commit and machine of each.

python benchmarks/results/render.py                 # every file
python benchmarks/results/render.py sharded_compare # one file (its name without .json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cell(value: object) -> str:
    return "" if value is None else str(value)


def render(path: Path) -> str:
    data = json.loads(path.read_text())
    if "tables" not in data:  # (fault_matrix.json has its own shape: benchmarks/fault_matrix.py --table prints it)
        return f"## {path.stem}\n\n`python benchmarks/fault_matrix.py --table benchmarks/results/fault_matrix.json` prints this file.\n"
    lines = [f"## {path.stem}: {data['benchmark']}", "", f"Machine: {data['machine']}", ""]
    if "command" in data:  # one command for every table (host_overhead.json): rows as records
        lines += [f"`{data['command']}` (commit `{data['commit']}`)", ""]
    for table in data["tables"]:
        lines += [f"### {table['title']}", ""]
        if "command" in table:
            lines += [f"`{table['command']}` (commit `{table['commit']}`, {table['network']})", ""]
        rows = table["rows"]
        columns = table.get("columns") or (list(rows[0]) if rows else [])
        if rows and isinstance(rows[0], dict):
            rows = [[row.get(column) for column in columns] for row in rows]
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        if table.get("notes"):
            lines += ["", table["notes"]]
        lines.append("")
    return "\n".join(lines)


def main(names: list[str]) -> None:
    paths = [HERE / f"{n}.json" for n in names] if names else sorted(HERE.glob("*.json"))
    print("\n".join(render(p) for p in paths))


if __name__ == "__main__":
    main(sys.argv[1:])
