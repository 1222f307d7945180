"""benchmarks/scale_out.py's CPU smoke run: the GPU script's whole path (checkpoint written, real
`batchinfer run` processes with 1 and 2 engines, the comparison and the table) on the tiny preset."""
from __future__ import annotations

import pytest

from benchmarks import scale_out


@pytest.mark.slow
def test_smoke_run_compares_one_and_two_engines_and_passes_its_checks(tmp_path, capsys):
    assert scale_out.main(["--smoke", "--folder", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rag N=2: 128/128 samples generate the same tokens as N=1" in out
    assert "CHECK FAILED" not in out
    rows = [line.split() for line in out.splitlines() if line.startswith("rag ") and "GPUs" not in line]
    table = [row for row in rows if len(row) > 10 and row[1] in ("1", "2")]
    assert [row[1] for row in table] == ["1", "2"]
    assert "rag N=2 worker 1 (cpu):" in out


def test_a_run_that_differs_is_a_failed_check():
    import pyarrow as pa

    def run(workers: int, tokens: list, cached: int) -> scale_out.RunResult:
        outputs = pa.table({"row_index": [0, 1], "sample_index": [0, 0], "output_token_ids": tokens,
                            "prompt_tokens": [5, 5], "cached_tokens": [0, cached], "completion_tokens": [2, 2]})
        stats = {"cached_tokens": cached, "plan": {"global_ideal_cached_tokens": 3}}
        return scale_out.RunResult("rag", workers, 1, 1.0, stats, outputs, {})

    same = run(1, [[1, 2], [3, 4]], 3)
    assert scale_out.compare([same, run(2, [[1, 2], [3, 4]], 3)], exact=True) == []
    assert scale_out.compare([same, run(2, [[1, 2], [3, 9]], 3)], exact=False) == []   # bf16: reported only
    assert "generations differ" in scale_out.compare([same, run(2, [[1, 2], [3, 9]], 3)], exact=True)[0]
    problems = scale_out.compare([same, run(2, [[1, 2], [3, 4]], 2)], exact=False)
    assert any("!= global ideal" in p for p in problems) and any("token counts" in p for p in problems)
