"""What loading our vLLM plugin costs each vLLM process: seconds, memory, and whether Lightning comes along.

vLLM loads the ``vllm.general_plugins`` entry points in every process it starts (front end,
engine core, each worker). This measures that, as vLLM does it, in fresh interpreters that have
imported vLLM already (as its processes have): ``python benchmarks/plugin_import.py [runs]``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

_PROBE = """
import json, resource, sys, time
import vllm.distributed.weight_transfer.factory  # a vLLM process has vLLM loaded before its plugins
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
from vllm.plugins import load_general_plugins
load_general_plugins()
seconds = time.perf_counter() - start
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
print(json.dumps({
    "seconds": seconds,
    "rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024,
    "gloo_registered": "gloo" in WeightTransferEngineFactory._registry,
    "imports_lightning": "lightning" in sys.modules or "lightning.pytorch" in sys.modules,
}))
"""


def measure(runs: int) -> dict[str, object]:
    """Median seconds and peak-RSS growth of loading vLLM's plugins over ``runs`` fresh interpreters."""
    results = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "runs": runs,
        "median_seconds": round(statistics.median(r["seconds"] for r in results), 3),
        "median_rss_mib": round(statistics.median(r["rss_mib"] for r in results), 1),
        "gloo_registered": all(r["gloo_registered"] for r in results),
        "imports_lightning": any(r["imports_lightning"] for r in results),
    }


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 5)))
