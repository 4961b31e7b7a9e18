"""The README's benchmark numbers are the ones the benchmarks wrote."""

from __future__ import annotations

import pytest

from bench import report


def test_readme_section_matches_the_results():
    assert report.main(["--check"]) == 0


def test_render_and_splice(tmp_path):
    (tmp_path / "gateway.md").write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "matrix.md").write_text("# M\n\n**10 cells: 9 pass / 1 warn / 0 fail / 0 n/a**\n")
    section = report.render(tmp_path)
    assert "| 1 | 2 |" in section and "10 cells: 9 pass / 1 warn / 0 fail / 0 n/a." in section
    assert "decode.md" not in section  # absent results are left out
    readme = f"intro\n{report.BEGIN}\nold numbers\n{report.END}\noutro\n"
    out = report.splice(readme, section)
    assert out.startswith("intro\n") and out.endswith("\noutro\n") and "old numbers" not in out
    with pytest.raises(ValueError, match="no generated benchmark section"):
        report.splice("no markers", section)
