from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"


def test_api_reference_matches_the_docstrings():
    """docs/api.md is what ``python docs/gen_api.py`` renders from the docstrings (rendered here, in
    process: the package is imported already)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    assert spec is not None and spec.loader is not None
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    assert gen_api.API_FILE.read_text() == gen_api.render(), "docs/api.md is out of date: run python docs/gen_api.py"


def test_every_doc_page_linked_from_the_readme_exists():
    readme = (DOCS.parent / "README.md").read_text()
    pages = (
        "quickstart.md",
        "concepts.md",
        "engines.md",
        "strategies.md",
        "gpu.md",
        "troubleshooting.md",
        "api.md",
        "index.md",
        "security.md",
        "lora.md",
        "torchrl.md",
        "moe.md",
    )
    for page in (*pages, "benchmarks.md"):
        assert f"docs/{page}" in readme and (DOCS / page).is_file(), page
