import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"


def test_api_reference_matches_the_docstrings():
    completed = subprocess.run(
        [sys.executable, str(DOCS / "gen_api.py"), "--check"], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-2000:]


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
    )
    for page in (*pages, "benchmarks.md"):
        assert f"docs/{page}" in readme and (DOCS / page).is_file(), page
