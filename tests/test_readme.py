"""README.md stays a user's guide: short enough to read through; the details live in docs/."""

import pathlib

README = pathlib.Path(__file__).parents[1] / "README.md"
MAX_LINES = 250


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, (f"README.md has {lines} lines, more than {MAX_LINES}: move details to docs/ "
                                "(weight-offload.md, activation-offload.md; tables to docs/benchmarks.md through bench/report.py)")
