"""Write docs/api.md from the docstrings of lightning_vllm's public API.

Run ``python docs/gen_api.py`` after changing a public docstring; a test runs
``python docs/gen_api.py --check`` (in a fresh interpreter, so no other test's imports
change what is rendered).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning_vllm
import lightning_vllm.torchrl  # TorchRL's weight-sync scheme (the torchrl extra, which make install installs)

API_FILE = Path(__file__).with_name("api.md")


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _doc(obj: object) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "").strip()


def _entry(module: object, prefix: str, name: str) -> list[str]:
    """The lines of ``module``'s public ``name``: its signature and docstring, and its documented members."""
    obj = getattr(module, name)
    if name != obj.__name__:  # an alias such as vLLMUpdater
        return [f"## `{prefix}{name}`", "", f"Another name for `{obj.__name__}`.", ""]
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"## `{prefix}{name}{_signature(obj)}`", "", f"*{kind}* in `{obj.__module__}`", "", _doc(obj), ""]
    if not inspect.isclass(obj):
        return lines
    # Members defined by the class or by a base of ours (VLLMUpdater's WeightSync),
    # not those inherited from Lightning, TorchRL or Python.
    ours = {key for base in obj.__mro__ if base.__module__.startswith("lightning_vllm") for key in vars(base)}
    for member_name, member in inspect.getmembers(obj):
        if member_name.startswith("_") or member_name not in ours or not _doc(member):
            continue
        if isinstance(inspect.getattr_static(obj, member_name), property):
            lines += [f"### `{name}.{member_name}` (property)", "", _doc(member), ""]
        elif callable(member):
            lines += [f"### `{name}.{member_name}{_signature(member)}`", "", _doc(member), ""]
    return lines


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.",
        "",
    ]
    # The package's names, then TorchRL's weight-sync scheme, whose module imports torchrl (docs/torchrl.md).
    for module, prefix in ((lightning_vllm, ""), (lightning_vllm.torchrl, "lightning_vllm.torchrl.")):
        for name in sorted(set(module.__all__), key=lambda name: (name.lower(), name)):
            lines += _entry(module, prefix, name)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    import sys

    if "--check" in sys.argv:
        if API_FILE.read_text() != render():
            sys.exit(f"{API_FILE} is out of date: run python docs/gen_api.py")
        print(f"{API_FILE} is up to date")
    else:
        API_FILE.write_text(render())
        print(f"wrote {API_FILE}")
