"""Every recipe in docs/recipes.md runs as written (after the set-up block)."""

import re
from pathlib import Path

import pytest

RECIPES = Path(__file__).parents[1] / "docs" / "recipes.md"


def sections():
    """(heading, code) for every python block, in order; the first is the set-up. A ``##`` section whose first
    block starts with ``# set-up`` runs it before each of its later blocks (each under its ``###`` heading)."""
    out, heading, local = [], None, ""
    text = RECIPES.read_text()
    for m in re.finditer(r"^(##|###) ([^\n]+)$|^```python\n(.*?)^```", text, re.M | re.S):
        if m.group(1):
            heading = m.group(2).strip()
            local = "" if m.group(1) == "##" else local
        elif m.group(3).startswith("# set-up") and not local:
            local = m.group(3)
        else:
            out.append((heading, local + m.group(3)))
    return out


SETUP, *RECIPE_BLOCKS = sections()


@pytest.fixture(scope="module")
def setup_namespace():
    namespace = {}
    exec(compile(SETUP[1], f"{RECIPES}:{SETUP[0]}", "exec"), namespace)
    return namespace


def test_recipes_exist():
    assert SETUP[0] == "Set-up" and len(RECIPE_BLOCKS) >= 5


@pytest.mark.parametrize("heading,code", RECIPE_BLOCKS, ids=[h for h, _ in RECIPE_BLOCKS])
def test_recipe_runs(setup_namespace, heading, code, capsys):
    exec(compile(code, f"{RECIPES}:{heading}", "exec"), dict(setup_namespace))
    assert capsys.readouterr().out  # every recipe shows its result
