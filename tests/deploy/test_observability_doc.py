"""docs/observability.md's series table is series.CATALOG's: generated, and checked here so
that it cannot drift. `python -m tests.deploy.test_observability_doc` rewrites it."""
from __future__ import annotations

from pathlib import Path

from adapterserve.server.metrics import series as s

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
BEGIN, END = "<!-- series table: generated from series.CATALOG -->\n", "<!-- end of series table -->\n"
SUFFIX = {"counter": "_total", "gauge": "", "histogram": "_bucket/_sum/_count"}


def series_table() -> str:
    rows = ["| series | kind | labels | what it counts |", "|---|---|---|---|"]
    for series in s.CATALOG.values():
        labels = ", ".join(f"`{label}`" for label in series.labels) or "-"
        where = " (metrics port only)" if series.full_only else ""
        rows.append(f"| `{series.name}{SUFFIX[series.kind]}` | {series.kind} | {labels} | {series.help}{where} |")
    return "\n".join(rows) + "\n"


def with_table(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + series_table() + END + rest.split(END, 1)[1]


def test_the_series_table_is_the_catalog():
    text = DOC.read_text()
    assert text == with_table(text), "run `python -m tests.deploy.test_observability_doc` to regenerate the table"
    for name in s.CATALOG:
        assert f"`{name}" in text
    for name in s.GATEWAY_NAMES:
        assert f"`{name}`" in text


if __name__ == "__main__":
    DOC.write_text(with_table(DOC.read_text()))
