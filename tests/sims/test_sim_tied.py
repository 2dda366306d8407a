"""The simulator's model of a tied embedding's split gradient (flowtrain.engine.embedding_rows):
under data parallel without ZeRO the engine reduces the head's part of the weight's gradient
during backward and exchanges the lookups' rows after the reduces. The plan puts the tied
weight's bucket first, reduces it after the head's backward and adds the rows' all-gather,
under the engine's own conditions, and prices the head's matmul where the head runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flowtrain.plan import names
from sim_helpers import cpu_profile, sim_config
from sims.executor import execute
from sims.layer_ops import SimOptions
from sims.models import get_model
from sims.planner import build_plan, distinct_rows, lay_out
from sims.workload import Layout, Workload

WIDTH, LAYERS, SEQ = 256, 4, 8


def gpt(vocab: int, tied: bool = True) -> Workload:
    """A GPT's parameters as the engine lists them: the (tied) token embedding first, the
    blocks, a final norm."""
    params = [("wte.weight", (vocab, WIDTH)), ("wpe.weight", (SEQ, WIDTH))]
    for layer in range(LAYERS):
        params += [(f"h.{layer}.fc.weight", (4 * WIDTH, WIDTH)),
                   (f"h.{layer}.fc.bias", (4 * WIDTH,)),
                   (f"h.{layer}.proj.weight", (WIDTH, 4 * WIDTH))]
    params += [("ln_f.weight", (WIDTH,)), ("ln_f.bias", (WIDTH,))]
    specs = tuple((name, shape, "float32", 4) for name, shape in params)
    flops = 2.0 * SEQ * sum(math.prod(shape) for _, shape in params)
    return Workload("tied-gpt", specs, flops, seq_len=SEQ, hidden=WIDTH, layers=LAYERS,
                    tied=(("wte.weight", float(SEQ)),) if tied else ())


def by_name(plan: object) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(plan.tasks)}  # type: ignore[attr-defined]


def test_the_split_reduces_the_tied_bucket_after_the_head_and_exchanges_rows() -> None:
    work, cfg = gpt(8192), sim_config(2)
    plan = build_plan(work, cfg, Layout(1, 2), cpu_profile())
    [stage] = plan.stages
    # first in gradient order, in a bucket of its own (larger than the first bucket's cap)
    assert [s.name for s in stage.buckets[0].slots] == ["wte.weight"]
    index = by_name(plan)
    reduce = plan.tasks[index[names.reduce(0)]]
    assert index[names.backward(0, "head")] in reduce.deps
    # the rows: 2 ranks x the distinct ids of a rank's 2 x 8 tokens, an id and a row of
    # fp32 each
    rows = plan.tasks[index[names.ROWS]]
    assert rows.bytes == 2 * math.ceil(distinct_rows(2 * SEQ, 8192)) * (WIDTH + 1) * 4
    last_reduce = max(i for name, i in index.items()
                      if name.startswith("reduce/bucket"))
    assert last_reduce in rows.deps
    assert names.ROWS in stage.step_plan.task_names()
    # the step waits for the rows before the optimizer
    assert index[names.ROWS] in plan.tasks[index[names.OPTIMIZER_STEP]].deps


def test_the_split_hides_the_tied_reduce_under_the_blocks_backward() -> None:
    work, hw = gpt(8192), cpu_profile()
    split = build_plan(work, sim_config(2), Layout(1, 2), hw)
    whole = build_plan(work, sim_config(2, flowtrain={"tied_embedding_rows": False}),
                       Layout(1, 2), hw)
    assert names.ROWS not in by_name(whole)
    # without the split the tied weight's gradient is complete only after the embedding's
    # backward, the last: its bucket is the last one
    assert "wte.weight" in [s.name for s in whole.stages[0].buckets[-1].slots]
    timed = {}
    for label, plan in (("split", split), ("whole", whole)):
        line = execute(plan.tasks, interference=plan.interference, slowdown=plan.slowdown)
        i = by_name(plan)
        wte = next(b.index for b in plan.stages[0].buckets
                   if "wte.weight" in [s.name for s in b.slots])
        backward_end = max(line.end[j] for name, j in i.items()
                           if name.startswith("backward/mb0"))
        timed[label] = (line.step_time, line.end[i[names.reduce(wte)]] - backward_end)
    # split: the tied bucket's reduce ends before backward does; whole, after it
    assert timed["split"][1] < 0 < timed["whole"][1]
    assert timed["split"][0] < timed["whole"][0]


@pytest.mark.parametrize("why", ["vocabulary", "zero1", "framework", "one rank"])
def test_no_split_where_the_engine_makes_none(why: str) -> None:
    work, cfg, layout, options = gpt(8192), sim_config(2), Layout(1, 2), None
    if why == "vocabulary":
        # 2 ranks x ~12.4 distinct ids of 16 tokens outnumber 20 rows: the engine reduces
        # densely from its first step on
        work = gpt(20)
    elif why == "zero1":
        cfg = sim_config(2, zero_optimization={"stage": 1})
    elif why == "framework":
        options = SimOptions(framework="deepspeed")
    else:
        cfg, layout = sim_config(1), Layout(1, 1)
    plan = build_plan(work, cfg, layout, cpu_profile(), options)
    assert names.ROWS not in by_name(plan)
    assert names.ROWS not in plan.stages[0].step_plan.task_names()
    if layout.dp > 1:
        wte = next(b for b in plan.stages[0].buckets
                   if "wte.weight" in [s.name for s in b.slots])
        assert wte.index == len(plan.stages[0].buckets) - 1


def test_the_head_matmul_is_priced_where_the_head_runs() -> None:
    """A tied weight's FLOPs (the head's matmul) are in the last segment's passes, the first
    to run in backward; untied, the same FLOPs sit with the embedding. The totals agree."""
    hw, cfg = cpu_profile(), sim_config(2, flowtrain={"tied_embedding_rows": False})
    seconds = {}
    for tied in (True, False):
        step = lay_out(gpt(8192, tied=tied), cfg, Layout(1, 2), hw)
        [costs] = step.costs
        seconds[tied] = (costs.backward_s[0], costs.backward_s[-1], sum(costs.backward_s))
    assert seconds[True][2] == pytest.approx(seconds[False][2])
    assert seconds[True][1] > seconds[False][1] and seconds[True][0] < seconds[False][0]


def test_distinct_rows_is_the_expected_count_of_uniform_draws() -> None:
    assert distinct_rows(1, 100) == pytest.approx(1.0)
    assert distinct_rows(2, 2) == pytest.approx(1.5)
    assert distinct_rows(10**6, 50) == pytest.approx(50.0)
    rng = np.random.default_rng(0)
    for tokens, vocab in ((64, 96), (1024, 50304), (300, 200)):
        counts = [len(np.unique(rng.integers(0, vocab, tokens))) for _ in range(2000)]
        assert distinct_rows(tokens, vocab) == pytest.approx(float(np.mean(counts)), rel=0.01)


def test_workloads_name_their_tied_embedding() -> None:
    gpt2 = Workload.from_model(get_model("gpt2", seq_len=512), "bf16")
    assert gpt2.tied == (("transformer.wte.weight", 512.0),)
    assert Workload.from_model(get_model("llama2-7b", seq_len=512), "bf16").tied == ()
    plan = {"param_specs": [["emb.weight", [10, 4], "float32", 4]],
            "forward_flops_per_micro_batch": 100.0,
            "tied_embeddings": [{"param": "emb.weight", "lookups_per_micro_batch": 30}]}
    assert Workload.from_run(plan, micro_batch_size=3).tied == (("emb.weight", 10.0),)
    del plan["tied_embeddings"]
    assert Workload.from_run(plan, micro_batch_size=3).tied == ()
