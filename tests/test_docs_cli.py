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


def test_families_md_is_current():
    from jstd.families import families_markdown

    assert (ROOT / "docs" / "families.md").read_text() == families_markdown(), \
        "run `make docs` to regenerate docs/families.md"


def refusal_claims(text: str) -> list[tuple[str, str]]:
    """``(model_type, sentence)`` for each backquoted name of a served ``model_type`` in a sentence that says
    something is refused (the docs' support claims, checked against the registry)."""
    import re

    from jstd.families import FAMILIES

    claims = []
    for sentence in re.split(r"(?<=[.;])\s+|\n\s*\n|\n- ", text):
        if re.search(r"\brefus(ed|es)\b", sentence):
            claims += [(name, " ".join(sentence.split())) for name in re.findall(r"`([a-z0-9_]+)`", sentence)
                       if name in FAMILIES]
    return claims


def test_no_doc_calls_a_served_family_refused():
    """README and docs/ state support as the registry has it: no sentence calls a model_type jstd loads refused."""
    assert refusal_claims("the MoE line `qwen3_5_moe` is refused.") == [
        ("qwen3_5_moe", "the MoE line `qwen3_5_moe` is refused.")]  # the check finds what it looks for
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    wrong = [(path.relative_to(ROOT), *claim) for path in docs for claim in refusal_claims(path.read_text())]
    assert not wrong, f"docs call served families refused (see docs/families.md): {wrong}"
