"""The trainer of tests/engines/test_across_hosts.py, run inside the trainer's network namespace.

``python across_hosts_run.py SERVER_URL MASTER_ADDRESS OUT_JSON``: waits for the server
(bounded), tries a push without the key, pushes with it, lists the TCP sockets this
process listens on while it is connected, checks what the server serves, and writes all
of it to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import engine_prompt_logprobs, hf_prompt_logprobs, max_abs_diff, tiny_qwen2, wait_for_health

from lightning_vllm import EngineConfigError, HTTPEngine, VLLMUpdater


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets ``pid`` listens on (``ss`` sees this namespace only)."""
    lines = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30, check=True).stdout
    return sorted({line.split()[3] for line in lines.splitlines() if f"pid={pid}," in line})


def main(url: str, master_address: str, out: str) -> None:
    wait_for_health(url, timeout=300)
    result: dict = {}
    try:
        VLLMUpdater(engine=HTTPEngine(url, api_key="not-the-key"), master_address=master_address).push_weights(
            tiny_qwen2(seed=41)
        )
        result["without_key"] = "pushed"
    except EngineConfigError as error:
        result["without_key"] = str(error)

    model = tiny_qwen2(seed=42)
    engine = HTTPEngine(url, api_key=os.environ["TEST_API_KEY"])
    updater = VLLMUpdater(engine=engine, master_address=master_address, timeout_seconds=60)
    result["version"] = updater.push_weights(model).weight_version
    result["listening"] = listening_addresses(os.getpid())
    result["logprob_gap"] = max_abs_diff(engine_prompt_logprobs(engine), hf_prompt_logprobs(model.eval()))
    updater.close()
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
