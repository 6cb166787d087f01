"""The reference page of every option, rendered from the option dataclasses (:mod:`collective_ops.options`).

``python -m collective_ops.tools.reference > docs/reference.md`` (or ``--write``, or ``--check`` to fail
where the page is not what the dataclasses render).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from ..options import OptimizerOptions, WrapOptions, field_docs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
FRAMEWORK_NAMES = {"torch": "PyTorch", "mindspore": "MindSpore"}

SECTIONS = (
    (
        "`collective_ops.wrap(model, bucket_size_mb, **options)`",
        WrapOptions,
        "The keywords `wrap()` takes for a `torch.nn.Module` or a `mindspore.nn.Cell`. DDP's constructor keywords "
        "are accepted under their DDP names (`bucket_cap_mb`, `forward_sync_buffers`); a keyword that only the "
        "other framework takes is refused with what to use instead.",
    ),
    (
        "`collective_ops.DistributedOptimizer(model, optimizer_class, *args, **options)`",
        OptimizerOptions,
        "The optimizer's own keywords; every other keyword goes to `optimizer_class`.",
    ),
)


def render() -> str:
    """The page: one table per options class, a row per field (name, frameworks, type, default, doc)."""
    lines = [
        "# Options reference",
        "",
        "Generated from `collective_ops/options.py` by `python -m collective_ops.tools.reference --write`; "
        "edit the dataclasses' field docs, not this page.",
    ]
    for title, cls, intro in SECTIONS:
        lines += ["", f"## {title}", "", intro, "", "| option | frameworks | type | default | description |"]
        lines.append("|---|---|---|---|---|")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            framework = f.metadata.get("framework")
            where = FRAMEWORK_NAMES[framework] if framework else "both"
            row = (f"`{f.name}`", where, _code(_type_text(f.type)), _code(repr(_default(f))), _cell(docs[f.name]))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _type_text(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _cell(text: str) -> str:
    """A docstring as a table cell: reST's double backquotes as Markdown's, pipes escaped."""
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return _cell(f"`{text}`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collective_ops.tools.reference", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write the page to {PAGE}")
    group.add_argument("--check", action="store_true", help="exit 1 where the page on disk is not current")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
    elif args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is not current: run python -m collective_ops.tools.reference --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
