"""`neuronpy bench --embeddings` on the tiny embedding fixture: every batch size measured for
both systems, the two systems' vectors the same computation, the table and the JSON written
(what the figures are, never how fast: a test does not time anything)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuronpy.bench import embeddings
from neuronpy.cli import main
from tests.servers import FIXTURES
from tests.test_fixtures import bf

MODEL = str(FIXTURES / bf.EMBEDDING_FIXTURE)


def test_the_embedding_bench_measures_both_systems_on_the_same_vectors() -> None:
    results = embeddings.run_embedding_bench(
        MODEL, batches=(1, 4), lengths="8-16", repeats=1, log=lambda _: None
    )
    assert [p.batch for p in results.points] == [1, 4]
    assert results.min_cosine >= 0.9999  # float32: the same computation
    assert (results.pooling.mode, results.pooling.normalize) == ("last", True)
    for point in results.points:
        assert 8 * point.batch <= point.tokens <= 16 * point.batch
        assert point.neuronpy_s > 0 and point.transformers_s > 0
        data = point.to_json()
        assert data["neuronpy"]["inputs_per_s"] == pytest.approx(point.batch / point.neuronpy_s)
    table = embeddings.format_table(results)
    assert "ratio" in table and table.count("x\n") == 2


def test_the_cli_writes_the_table_and_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["bench", "--embeddings", "--model", MODEL, "--embed-batches", "2"]
    code = main([*argv, "--embed-len", "12", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("bench-*-embeddings.json")
    data = json.loads(path.read_text())
    assert [p["batch"] for p in data["points"]] == [2]
    assert data["points"][0]["tokens"] == 24 and data["min_cosine"] >= 0.9999
    assert "transformers in/s" in capsys.readouterr().out


def test_input_lengths_are_one_length_or_a_range() -> None:
    assert embeddings.parse_lengths("128") == (128, 128)
    assert embeddings.parse_lengths("64-192") == (64, 192)
    for text in ("0", "9-3", "x", "1-y"):
        with pytest.raises(ValueError, match="input lengths"):
            embeddings.parse_lengths(text)
