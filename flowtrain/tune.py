"""``flowtrain.tune``: the Python door to ``flowtrain tune``. The search is the simulator's
(``sims.tune``), imported when called: flowtrain itself never imports the simulator at import
time, as its CLI does not.

    from flowtrain import tune
    result = tune.search("gpt:build_demo_model", {"train_batch_size": 32, ...},
                         cluster="this-host", seq_len=64)
    tune.verify(result, 3, seq_len=64)      # short real trials; picks by measurement
    result.chosen_config()                  # the ds_config to train with
"""

from __future__ import annotations

from typing import Any


def search(model: str, config: dict[str, Any], **options: Any) -> Any:
    """``sims.tune.search``: every configuration predicted, the fitting ones ranked by
    throughput (a ``sims.tune.TuneResult``)."""
    from sims.tune import search as run

    return run(model, config, **options)


def verify(result: Any, k: int = 3, **options: Any) -> Any:
    """``sims.tune_trials.verify``: the ``k`` best run as short real trials on this host,
    the pick made by measurement."""
    from sims.tune_trials import verify as run

    return run(result, k, **options)


def confirm_largest_micro_batch(result: Any, **options: Any) -> dict[str, Any]:
    """``sims.tune_trials.confirm_largest_micro_batch``: the largest micro-batch predicted to
    fit, confirmed by a trial that does not run out of memory (halving while one does)."""
    from sims.tune_trials import confirm_largest_micro_batch as run

    return dict(run(result, **options))
