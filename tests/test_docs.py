import importlib.util
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"


def test_api_reference_matches_the_docstrings():
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DOCS / "api.md").read_text() == module.render(), "run: python docs/gen_api.py"


def test_every_doc_page_linked_from_the_readme_exists():
    readme = (DOCS.parent / "README.md").read_text()
    for page in ("quickstart.md", "concepts.md", "engines.md", "gpu.md", "troubleshooting.md", "api.md", "index.md"):
        assert f"docs/{page}" in readme and (DOCS / page).is_file(), page
