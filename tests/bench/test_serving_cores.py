"""``bench/serving_cores.py`` runs end to end on a tiny setting (N = 1 and 2) and prints its medians."""

from __future__ import annotations

import pytest

from tests.bench.test_bench_scripts import run_script


@pytest.mark.slow
def test_serving_cores_bench_measures_one_and_two_processes() -> None:
    done = run_script(
        "serving_cores.py", "--processes", "1", "2", "--requests", "60", "--concurrency", "4", "--repeats", "1"
    )
    medians = done.stdout.split("# medians of 1 runs", 1)[1].splitlines()[1:]
    rows = {tuple(line.split()[:2]) for line in medians if line.strip()}
    assert rows == {("direct", "-"), ("uvicorn", "1"), ("uvicorn", "2")}
    for line in medians:
        assert float(line.split()[4]) > 0  # req/s: every request answered (a failure aborts the run)
