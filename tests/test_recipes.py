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
    namespace = dict(setup_namespace)
    exec(compile(code, f"{RECIPES}:{heading}", "exec"), namespace)
    assert capsys.readouterr().out  # every recipe shows its result
    if heading in CHECKS:
        CHECKS[heading](namespace)


def induction_graph(ns):
    """The induction recipe's claims, checked apart from its own asserts: the graph's top logit is the model's own
    prediction and the copied word; the top path is the copied token's edge into it, no other source's share is
    larger, and the path's numbers are the adjacency's; the figure and the page are written, the page pinning the
    logit."""
    import json
    import re

    import numpy as np

    jstd, graph, path, prompt, q, period = (ns[k] for k in ("jstd", "graph", "path", "prompt", "q", "period"))
    logits = np.asarray(jstd.run(ns["ind"], prompt[None]).logits)[0, -1]
    assert graph.logit_token_ids[0] == np.argmax(logits) == prompt[q - period + 1]
    source, logit = graph.token_start + q - period + 1, graph.logit_start
    assert path.nodes == [source, logit]
    row = np.abs(graph.adjacency[logit])
    assert np.argmax(row) == source and path.shares[0] == pytest.approx(row[source] / row.sum(), rel=1e-5)
    assert path.weights[0] == graph.adjacency[logit, source] > 0
    from PIL import Image

    png = np.asarray(Image.open(ns["folder"] / "induction-graph.png").convert("L"))
    assert (png < 128).mean() > 0.005                                       # drawn, not blank
    data = json.loads(re.search(r'id="page-data">(.*?)</script>', ns["page"].read_text(), re.S).group(1))
    assert data["qParams"]["clickedId"] == f"{graph.num_layers + 1}_{graph.logit_token_ids[0]}_{q}"
    if ns["jstd"].viewer.find_chromium():
        shot = np.asarray(Image.open(ns["folder"] / "induction-graph-viewer.png").convert("L"))
        assert shot.shape == (700, 1400) and (shot < 128).mean() > 0.005


CHECKS = {"An induction circuit in an attribution graph": induction_graph}
