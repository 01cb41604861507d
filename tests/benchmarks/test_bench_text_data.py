"""bench_text_data: tokenising and loading run in fresh processes, on 1x and 10x corpora, and report what they saw."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_text_data as bench


@pytest.mark.slow
def test_tiny_corpora_tokenise_identically_on_any_thread_count_and_load_whole_epochs(tmp_path, capsys):
    assert bench.main(["--quick", "--base-mb", "0.3", "--step-repeats", "0", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "text_data_quick.json").read_text())
    one, ten = res["corpora"]["1x"], res["corpora"]["10x"]
    assert one["tokenize 1 thread"]["tokens"] == one["tokenize all cores"]["tokens"] > 0
    assert 9 < ten["text_bytes"] / one["text_bytes"] < 11  # "about": each corpus ends with a whole document
    # more than 10x the tokens: the tokenizer was trained on the 1x corpus and splits the other modules finer
    assert ten["tokenize all cores"]["tokens"] / one["tokenize all cores"]["tokens"] > 9
    for corpus in (one, ten):
        epochs = {corpus[f"load workers={w}"]["rows"] for w in (0, 2)}
        assert len(epochs) == 1  # workers change nothing about what an epoch holds
        assert all(corpus[f"load workers={w}"]["peak_rss_bytes"] > 0 for w in (0, 2))
    assert corpus["load workers=2"]["peak_rss_workers_bytes"] > 0  # the workers were reaped and counted
    assert "tokens/s" in capsys.readouterr().out


def test_the_generated_corpus_has_the_size_asked_and_distinct_documents(tmp_path):
    written = bench.write_corpus(tmp_path / "c", 0.5, shard_mb=0.2)
    shards = sorted((tmp_path / "c").iterdir())
    documents = [json.loads(line)["text"] for shard in shards for line in shard.read_text().splitlines()]
    assert len(shards) >= 2 and 0.5 * 2**20 <= written == sum(map(len, documents)) < 0.5 * 2**20 + 300_000
    assert len(set(documents)) == len(documents)
