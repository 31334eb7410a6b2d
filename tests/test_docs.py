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


def test_the_readmes_loss_is_defined_and_a_step_on_it_makes_a_rewarded_rollout_likelier():
    """The README's example defines its loss; here it runs on a tiny model and two groups of rollouts."""
    import re

    import torch
    from helpers import tiny_qwen2

    from lightning_vllm.engines import Generation

    readme = (DOCS.parent / "README.md").read_text()
    source = re.search(r"\ndef grpo_loss\(.*?\n    return torch.stack\(losses\).mean\(\)\n", readme, re.S)
    assert source is not None, "the README's example defines grpo_loss"
    namespace: dict = {"torch": torch}
    exec(source.group(0), namespace)
    model = tiny_qwen2(seed=0)
    rollouts = [Generation(prompt_token_ids=[1, 2, 3], token_ids=[4 + i, 5]) for i in range(4)]

    def likelihood(rollout: Generation) -> float:
        """log p of the rollout's first token after its prompt."""
        with torch.no_grad():
            logits = model(torch.tensor([rollout.prompt_token_ids])).logits[0, -1]
            return float(logits.log_softmax(-1)[rollout.token_ids[0]])

    before = likelihood(rollouts[0])
    loss = namespace["grpo_loss"](model, rollouts, [1.0, 0.0, 0.0, 1.0], group_size=2)
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
    assert likelihood(rollouts[0]) > before  # rewarded over its group: likelier


def test_every_link_between_the_docs_names_a_file_and_a_heading_that_exist():
    import re

    def anchor(heading: str) -> str:  # (GitHub's: lower case, punctuation dropped, spaces to hyphens)
        return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")

    pages = [*DOCS.glob("**/*.md"), DOCS.parent / "README.md"]
    headings = {
        page.resolve(): {anchor(line) for line in page.read_text().splitlines() if line.startswith("#")}
        for page in pages
    }
    broken = []
    for page in pages:
        in_code = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            in_code ^= line.startswith("```")
            for target in [] if in_code else re.findall(r"\]\(([^)\s]+)\)", line):
                path, _, fragment = target.partition("#")
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                destination = (page.parent / path).resolve() if path else page.resolve()
                if not destination.exists() or (
                    fragment and destination.suffix == ".md" and fragment not in headings[destination]
                ):
                    broken.append(f"{page.relative_to(DOCS.parent)}:{number}: {target}")
    assert not broken, "\n".join(broken)


def test_defaults_quoted_in_the_docs_are_the_codes():
    import ast
    import inspect
    import re

    from lightning_vllm import VLLMUpdater, VLLMWeightSync

    defaults: dict[str, list] = {}
    for constructor in (VLLMWeightSync.__init__, VLLMUpdater.__init__):
        for name, parameter in inspect.signature(constructor).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                defaults.setdefault(name, []).append(parameter.default)
    # `name=value`, the default / `name=value` (the default) / `name` (default value)
    patterns = (r"`(\w+)=([^`]+)`,? \(?the default", r"`(\w+)` \(default ([^)]+)\)")
    quoted, wrong = [], []
    for page in [*DOCS.glob("*.md"), DOCS.parent / "README.md"]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in patterns:
                for name, text in re.findall(pattern, line):
                    if name not in defaults:
                        continue
                    try:
                        value = ast.literal_eval(text)
                    except (ValueError, SyntaxError):
                        value = text
                    quoted.append(name)
                    if value not in defaults[name]:
                        wrong.append(
                            f"{page.name}:{number}: {name}={text!s}, the code's default is {defaults[name][0]!r}"
                        )
    assert len(quoted) >= 5, quoted  # (the patterns still find what the docs quote)
    assert not wrong, "\n".join(wrong)


GUIDE_FIGURES_ALLOWED: dict[str, str] = {
    "8.6": "multinode.md: arithmetic, not a measurement (1 GiB at 1 Gbit/s)",
    "15.3": "gpu.md's recipes: arithmetic, not a measurement (30.5B bf16 parameters over 4 GPUs)",
    "27.8": "lora.md: the adapter's serving time on vLLM's CPU ops, measured once by hand when the grouped ops were "
    "written; the benchmark that keeps records (make bench) times pushes, not serving",
}
"""Figures a guide may quote that no record holds, each with why. Everything else a guide quotes
as a measurement comes from docs/runs.md, docs/benchmarks.md or a raw record in docs/gpu-runs/ (issue 68)."""


def test_every_measured_figure_in_the_guides_is_in_a_record():
    import json
    import re

    records = [DOCS / "runs.md", DOCS / "benchmarks.md", *sorted((DOCS / "gpu-runs").glob("*.json"))]
    text = "\n".join(path.read_text() for path in records)
    held = set(re.findall(r"\d+\.\d+", text))
    for path in (DOCS / "gpu-runs").glob("*.json"):  # (raw floats, quoted rounded)
        for number in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", path.read_text()):
            value = float(number)
            held |= {f"{value:.{digits}f}" for digits in range(1, 5)}
    measured = re.compile(r"(?<![\w.])(\d+\.\d+)\s?(?:×|x\b|s\b|ms\b|GB\b|MB\b|GiB\b|%)")
    guides = [
        DOCS.parent / "README.md",
        *(page for page in DOCS.glob("*.md") if page.name not in {"runs.md", "benchmarks.md", "api.md"}),
    ]
    unsourced = []
    for page in guides:
        in_code = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            in_code ^= line.startswith("```")
            for figure in [] if in_code else measured.findall(line):
                if figure not in held and figure not in GUIDE_FIGURES_ALLOWED:
                    unsourced.append(f"{page.name}:{number}: {figure}")
    assert not unsourced, "quoted in a guide, found in no record:\n" + "\n".join(unsourced)
    json.dumps(GUIDE_FIGURES_ALLOWED)  # (the allow-list stays plain data)


def test_the_gpu_recipes_on_the_page_are_the_examples():
    """docs/gpu.md's recipes quote ``examples/gpu_recipes.py`` (which ``make test-gpu-recipes`` runs): the callback's
    and the Trainer's literal arguments, and each ``vllm serve`` line's flags and GPUs."""
    import ast
    import importlib.util
    import re
    import sys

    spec = importlib.util.spec_from_file_location("gpu_recipes", DOCS.parent / "examples" / "gpu_recipes.py")
    assert spec is not None and spec.loader is not None
    recipes = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipes  # (its dataclass looks its module up)
    try:
        spec.loader.exec_module(recipes)
    finally:
        del sys.modules[spec.name]
    page = (DOCS / "gpu.md").read_text()

    def section(heading: str) -> str:
        return re.split(r"\n##+ ", page.split(f"### {heading}\n", 1)[1], maxsplit=1)[0]

    def literal_arguments(code: str, function: str) -> dict:
        (call,) = [
            node for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == function
        ]  # fmt: skip
        found = {}
        for keyword in call.keywords:
            try:
                found[keyword.arg] = ast.literal_eval(keyword.value)
            except ValueError:  # (a strategy, the callbacks: built, not quoted)
                continue
        return found

    for heading, recipe in (("Qwen3-8B on one node", recipes.QWEN3_8B), ("Qwen3-30B-A3B on three nodes",
                                                                          recipes.QWEN3_30B_A3B)):  # fmt: skip
        text = section(heading)
        code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
        callback = literal_arguments(code, "VLLMWeightSync")
        expected = {**recipe.callback, "engine": recipe.engine if recipe.engine_gpus else list(recipe.servers)}
        if recipe.engine_gpus:
            expected["engine_gpus"] = recipe.engine_gpus
        assert callback == expected, heading
        assert literal_arguments(code, "Trainer") == recipe.trainer, heading
        serve = r"CUDA_VISIBLE_DEVICES=(\S+) VLLM_SERVER_DEV_MODE=1 vllm serve (\S+) --port (\d+)(.*?)'\n"
        serve_lines = re.findall(serve, " ".join(text.split("\\\n")), flags=re.S)
        assert [(gpus, f"http://engines:{port}") for gpus, _, port, _ in serve_lines] == list(
            zip(recipe.serve_gpus, recipe.servers)
        ), heading
        for _, model, _, flags in serve_lines:
            served = {"model": model}
            for flag, value in re.findall(r"--([\w-]+)(?: ('[^']*'|[^\s-][^\s]*))?", flags + "'"):
                served[flag.replace("-", "_")] = (
                    True if not value else ast.literal_eval(value) if value[0] in "'0123456789" else value
                )
            served["weight_transfer_config"] = ast.literal_eval(served["weight_transfer_config"])
            assert served == recipe.engine, heading
