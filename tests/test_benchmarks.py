"""The benchmark suite keeps working: a smoke run at its smallest size, and its report helpers.

Nothing here asserts a time: the figures live in docs/benchmarks.md, made by `make bench`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from report import RESULTS_END, RESULTS_START, ModelResult, linear_fit, ratios_line, replace_results  # noqa: E402

RATIOS = re.compile(
    r"^ratios: floor_over_ours=\d+\.\d+ disk_over_ours=\d+\.\d+ per_tensor_over_ours=\d+\.\d+ "
    r"peak_mem_over_bucket=\d+\.\d+ sharded_peak_over_group_plus_bucket=\d+\.\d+ "
    r"ours_over_overlap_floor=\d+\.\d+ async_stall_over_blocking=\d+\.\d+ checked_over_ours=\d+\.\d+ "
    r"checked_layers=(\d+)/\1$"
)


@pytest.mark.engine
def test_the_suite_runs_at_its_smallest_size_and_measures_what_it_reports(tmp_path):
    page, figures_file = tmp_path / "benchmarks.md", tmp_path / "figures.json"
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--quick", "--page", str(page), "--json", str(figures_file)],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    last = completed.stdout.strip().splitlines()[-1]
    assert RATIOS.match(last), completed.stdout[-2000:]
    assert all(0 < float(value) < 1e6 for value in re.findall(r"=(\d+\.\d+)", last))
    figures = json.loads(figures_file.read_text())
    (model,) = figures["models"]  # --quick: the smallest size only
    # Every method was timed once, and ours sent what the model holds.
    for method in ("ours", "checked", "frozen_embed", "disk", "per_tensor", "streaming", "floor"):
        assert len(model["seconds"][method]) == 1 and model["seconds"][method][0] > 0, method
    assert abs(model["bytes_sent"]["ours"] - model["num_bytes"]) <= model["num_bytes"] // 100
    # With the embedding frozen, a changed-only push leaves its 12.6 MB out.
    assert model["num_bytes"] - model["bytes_sent"]["frozen_embed"] >= 12_000_000
    # The staging memory stays within one bucket; the sharded push and the stall were measured.
    assert 0 < model["peak_extra_bytes"] <= 2 * model["bucket_size_bytes"]
    assert figures["sharded"] and figures["stall"] and figures["many_tensors"]["num_tensors"] > 100
    assert (tmp_path / "images" / "benchmarks.png").stat().st_size > 10_000
    assert RESULTS_START in page.read_text() and RESULTS_END in page.read_text()


def result(name: str, num_bytes: int, **seconds: list[float]) -> ModelResult:
    return ModelResult(
        name, 0, 0, num_bytes, dict(seconds), peak_extra_bytes=num_bytes // 2, bucket_size_bytes=num_bytes
    )


def test_the_fit_recovers_a_line_and_the_ratios_are_medians():
    results = [result(str(n), n, ours=[0.1 + n / 2e9] * 3) for n in (10**8, 2 * 10**8, 4 * 10**8)]
    fit = linear_fit(results, "ours")
    assert fit.intercept_seconds == pytest.approx(0.1) and fit.bytes_per_second == pytest.approx(2e9)
    assert fit.r_squared == pytest.approx(1.0)
    largest = result("L", 100, ours=[1.0, 2.0, 9.0], checked=[2.5], floor=[1.5], disk=[4.0])
    largest.transport_seconds, largest.load_seconds = [0.5, 0.6, 0.7], [1.5, 1.6, 1.7]
    largest.checked_layers = [(171, 171), (170, 171)]  # (the fewest a checked push compared, of how many)
    many = result("M", 10, ours=[0.5], per_tensor=[5.0])
    assert largest.overlap_floor == 1.6  # the slower of the two parts alone, not their sum
    assert ratios_line(largest, many, 1.25, 0.1) == (
        "ratios: floor_over_ours=0.750 disk_over_ours=2.000 per_tensor_over_ours=10.000 peak_mem_over_bucket=0.500 "
        "sharded_peak_over_group_plus_bucket=1.250 ours_over_overlap_floor=1.250 async_stall_over_blocking=0.100 "
        "checked_over_ours=1.250 checked_layers=170/171"
    )


def test_results_replace_only_their_section_of_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nprose before\n\n{RESULTS_START}\nold\n{RESULTS_END}\n\nprose after\n")
    replace_results(page, "new table")
    assert page.read_text() == f"# Title\n\nprose before\n\n{RESULTS_START}\nnew table\n{RESULTS_END}\n\nprose after\n"
    (tmp_path / "bare.md").write_text("no markers")
    with pytest.raises(ValueError, match="no <!-- results:start -->"):
        replace_results(tmp_path / "bare.md", "x")


def test_the_lora_table_and_line_report_merged_over_adapter():
    from lora import LoraResult, lora_line, lora_table

    result = LoraResult("400M", num_bytes={"merged": 800_000_000, "adapter": 8_000_000})
    result.push_seconds = {"merged": [2.0, 2.5, 3.0], "adapter": [0.1, 0.1, 0.2]}
    result.served_seconds = {"merged": [2.1, 2.6, 3.1], "adapter": [0.2, 0.25, 0.3]}
    assert "| 400M | adapter | 8.00 | 0.100 | 0.250 | 100.0 | 25.0 |" in lora_table([result])
    assert lora_line(result) == (
        "lora 400M: merged_over_adapter_bytes=100.0 merged_over_adapter_seconds=25.0 with_first_request=10.4"
    )
