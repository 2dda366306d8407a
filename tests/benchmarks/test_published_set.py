"""The published set's split (benchmarks/published_split.json): every batch split by its rule
before scoring, every run in a batch, and no run's inputs changed without a quoted reason."""

from __future__ import annotations

import copy

import published_set as ps


def test_every_batch_is_split_by_the_rule_and_every_run_is_frozen() -> None:
    runs, split = ps.load_runs(), ps.load_split()
    assert ps.split_problems(runs, split) == []
    sources = {r["source"] for r in runs}
    held = ps.held_out_sources(split)
    # at least a third of the sources, and of each batch, held out
    assert 3 * len(held & sources) >= len(sources)
    for batch in split["batches"]:
        assert 3 * len(batch["held_out"]) >= len(batch["sources"])


def test_the_rule_is_the_salted_hash_order() -> None:
    # the first third by sha256(salt + source); an order that is not the names' own
    assert ps.split_batch(["a", "b", "c", "d"]) == sorted(ps.split_batch(["d", "c", "b", "a"]))
    assert len(ps.split_batch([f"s{i}" for i in range(7)])) == 3
    picked = ps.split_batch([f"s{i}" for i in range(30)])
    assert picked != [f"s{i}" for i in range(10)]


def test_an_input_changed_without_a_quote_is_caught() -> None:
    runs, split = ps.load_runs(), ps.load_split()
    run = copy.deepcopy(runs[0])
    old = run["batch"]["micro_batch"]
    run["batch"]["micro_batch"] = old + 1
    assert any("logs no change" in p for p in ps.split_problems([run], split))
    run["input_changes"] = [{"date": "2026-12-07", "field": "batch.micro_batch", "from": old,
                             "to": old + 1, "quote": "", "why": "a test"}]
    assert any("no 'quote'" in p for p in ps.split_problems([run], split))
    run["input_changes"][0]["quote"] = "the micro-batch was two"
    assert ps.split_problems([run], split) == []
    run["batch"]["micro_batch"] = old + 2  # the log no longer says what the run holds
    assert any("the log says" in p for p in ps.split_problems([run], split))


def test_a_source_in_no_batch_cannot_be_scored() -> None:
    runs, split = ps.load_runs(), ps.load_split()
    run = copy.deepcopy(runs[0])
    run["source"] = "a-new-paper"
    assert any("in no batch" in p for p in ps.split_problems([run], split))
    try:
        ps.part_of("a-new-paper", split)
    except KeyError as exc:
        assert "split_batch" in str(exc)
    else:
        raise AssertionError("part_of accepted a source no batch has split")
