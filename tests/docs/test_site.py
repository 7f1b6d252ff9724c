"""The documentation site builds with --strict (every page in the navigation, every link and anchor found,
every README snippet present, the reference pages rendered), the README stays a short front page whose
links lead somewhere, and the Embeddings guide's two-model configuration loads and names models this
checkout has."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conveyor.checkpoints.sources import parse_source
from conveyor.core.lifecycle import JOB_TRANSITIONS
from conveyor.core.settings import load_settings
from tests.support.doc_pages import RUN_PAGES

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
README_MAX_LINES = 200
EMBEDDINGS_PAGE = REPO_ROOT / "docs/guides/embeddings.md"


def test_the_site_builds_strictly_with_every_reference_page(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("reference/settings", "reference/http-api", "reference/cli", "getting-started/quickstart"):
        assert (site / page / "index.html").is_file(), page
    quickstart = (site / "getting-started/quickstart/index.html").read_text()
    assert "make serve" in quickstart and "curl" in quickstart, "the README's snippets are missing"
    assert (site / "reference/openapi.json").is_file()


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) >= 15, "the README should link into the documentation"
    missing = [link for link in local if not (REPO_ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_page_is_reachable_from_the_navigation() -> None:
    nav = (REPO_ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(REPO_ROOT / "docs").as_posix() for p in (REPO_ROOT / "docs").rglob("*.md")]
    assert pages
    assert not [p for p in pages if p not in nav], "pages left out of mkdocs.yml's nav"


def test_the_lifecycle_diagram_is_the_stores_transitions() -> None:
    page = (REPO_ROOT / "docs/design/architecture.md").read_text()
    diagram = page[page.index("stateDiagram-v2"):]
    diagram = diagram[:diagram.index("```")]
    drawn = {(a, b) for a, b in re.findall(r"^\s*(\w+) --> (\w+)", diagram, re.MULTILINE)}
    allowed = {(a, b) for a, targets in JOB_TRANSITIONS.items() for b in targets}
    assert drawn == allowed


# Every page with shell or Python blocks that tests/docs/test_readme.py does not run (RUN_PAGES) says why, so
# a new page cannot quietly promise what nothing checks.
NOT_RUN = re.compile(r"^<!-- blocks not run by tests/docs: .+ -->$", re.MULTILINE)


def test_every_page_with_commands_is_run_or_says_why_not() -> None:
    unmarked = []
    for path in sorted((REPO_ROOT / "docs").rglob("*.md")):
        name = path.relative_to(REPO_ROOT).as_posix()
        text = path.read_text()
        runnable = re.search(r"^```(bash|sh|shell|python)$", text, re.MULTILINE)
        if runnable and name not in RUN_PAGES and not NOT_RUN.search(text):
            unmarked.append(name)
        if name in RUN_PAGES:
            assert not NOT_RUN.search(text), f"{name} is run, yet says it is not"
    assert not unmarked, f"pages with commands nobody runs and no reason given: {unmarked}"


def test_the_embeddings_two_model_config_loads_and_both_models_resolve(tmp_path: Path) -> None:
    """The guide's registry of SmolLM2-135M-Instruct and all-MiniLM-L6-v2, read by the service's own loader:
    both ids served, the chat model the default, each `package:` source an installed model (no model is
    loaded)."""
    blocks = re.findall(r"^```toml\n(.*?)^```$", EMBEDDINGS_PAGE.read_text(), flags=re.MULTILINE | re.DOTALL)
    packaged = [block for block in blocks if "package:" in block]
    assert len(packaged) == 1, f"expected one TOML block with package: sources, found {len(packaged)}"
    config = tmp_path / "two-models.toml"
    config.write_text(packaged[0])
    settings = load_settings(config)
    assert settings.model_ids() == ["SmolLM2-135M-Instruct", "minilm"]
    paths = {}
    for model_id in settings.model_ids():
        source = settings.for_model(model_id).model
        assert source is not None and source.startswith("package:"), (model_id, source)
        path = parse_source(source).path
        assert path is not None and path.exists(), f"{model_id}: {source} is no installed model ({path})"
        paths[model_id] = path
    assert paths["SmolLM2-135M-Instruct"].suffix == ".gguf"
    assert (paths["minilm"] / "modules.json").is_file()  # a sentence-transformers folder
