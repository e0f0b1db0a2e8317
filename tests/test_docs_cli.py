"""Generated docs are current; the command line runs."""

from pathlib import Path

from jstd import cli
from jstd.core.sites import SITES
from jstd.families import values_markdown

ROOT = Path(__file__).parents[1]


def test_values_md_is_current():
    assert (ROOT / "docs" / "values.md").read_text() == values_markdown(), "run `make docs` to regenerate docs/values.md"


def test_every_site_has_a_layout_and_meaning():
    for s in SITES.values():
        assert s.layout and s.meaning.endswith((".", ")")), s.name


def test_inspect(capsys):
    cli.main(["inspect"])
    out = capsys.readouterr().out
    assert "layers.slots[0].attn.q" in out and "[layers=4, embed=64, heads=4, head_dim=16]" in out
    assert "attention_keys" in out and "kv_heads=2" in out
