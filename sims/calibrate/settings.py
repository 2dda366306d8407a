"""What ``flowtrain calibrate`` measures: the sizes and repetitions of each measurement
(``Settings``, full and ``--quick``), the measurement record's version and the error that
measuring or fitting raises. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass

MEASUREMENTS_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
MEASURED_OPS = ("all_reduce", "reduce_scatter", "all_gather")
CHANNEL_OPS = ("all_reduce", "reduce_scatter")  # what the engine's reducer sends over shm

# (rows, in, out) of the nn.Linear ops timed: log-spaced from a call that is all overhead to one
# that is all matmul, with varied aspect ratios.
PASS_SHAPES = ((8, 16, 16), (16, 48, 48), (32, 96, 192), (48, 192, 384), (96, 384, 512),
               (160, 640, 768), (320, 768, 1024))
QUICK_PASS_SHAPES = ((8, 16, 16), (32, 96, 192), (96, 384, 512), (160, 640, 768))
# Shapes of equal FLOPs (2^25) and weights of 0.25-4 MiB: how a layer's time grows with its
# weights when its FLOPs do not (fewer rows per weight)
WEIGHT_SHAPES = ((256, 256, 256), (64, 256, 1024), (32, 512, 1024), (16, 1024, 1024))
# The op every rank runs at once in the concurrency test, and the host-speed probe's pass
# (short, so the probe takes half a second).
CONCURRENCY_SHAPE = (96, 384, 512)
# (tensors, elements each) the optimizer kernel steps per call: call-bound to DRAM-bound
OPTIMIZER_SETS = ((256, 1 << 12), (32, 1 << 16), (16, 1 << 18), (4, 1 << 20))
QUICK_OPTIMIZER_SETS = ((128, 1 << 12), (4, 1 << 20))
JOB_STEPS = 16  # steps of each launched job size (the first left out)


class CalibrationError(RuntimeError):
    """Measuring or fitting failed; the message says what and how to retry."""


@dataclass(frozen=True)
class Settings:
    """How much to measure: --quick trades points and repetitions for time."""

    matmul_sizes: tuple[int, ...]  # square fp32 matmuls, n x n @ n x n
    low_precision_sizes: tuple[int, ...]  # bf16 / fp16, stopped early when too slow
    seconds_per_point: float  # each matmul or copy size is repeated for about this long
    max_op_seconds: float  # skip larger sizes of a dtype once one op would take longer
    memory_elements: int  # float32 elements in the copy benchmark (well past the L3 cache)
    collective_bytes: tuple[int, ...]  # full-buffer sizes, multiples of 4 x 4 B x ranks
    collective_trials: int
    trial_seconds: float  # back-to-back collectives per trial, about this long
    interference_bytes: int
    interference_window_s: float
    # the engine's own pieces (sims.calibrate.engine_pieces)
    pass_shapes: tuple[tuple[int, int, int], ...] = PASS_SHAPES
    optimizer_sets: tuple[tuple[int, int], ...] = OPTIMIZER_SETS
    weight_shapes: tuple[tuple[int, int, int], ...] = WEIGHT_SHAPES
    p2p_bytes: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
    concurrency_window_s: float = 0.5
    # (ranks, pipeline stages) of the launched calibration jobs (None: data parallel on 1 and
    # every measured rank count, and a 2-stage pipeline)
    jobs: tuple[tuple[int, int], ...] | None = None
    job_runs: int = 3  # each job's runs, a round over all jobs after the other; each size's
    # median quiet run is kept, so that one slow round does not move the fit
    job_steps: int = JOB_STEPS  # steps of each size (the first left out)


DEFAULT = Settings(
    matmul_sizes=(32, 64, 128, 256, 512, 1024), low_precision_sizes=(64, 256, 512, 1024),
    seconds_per_point=0.1, max_op_seconds=0.1, memory_elements=1 << 25,
    collective_bytes=(4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 25 << 20),
    collective_trials=7, trial_seconds=0.03, interference_bytes=8 << 20,
    interference_window_s=1.0)
QUICK = Settings(
    matmul_sizes=(64, 256, 512), low_precision_sizes=(256, 512), seconds_per_point=0.04,
    max_op_seconds=0.03, memory_elements=1 << 24,
    collective_bytes=(16 << 10, 1 << 20, 8 << 20), collective_trials=3, trial_seconds=0.02,
    interference_bytes=4 << 20, interference_window_s=0.4,
    pass_shapes=QUICK_PASS_SHAPES,
    optimizer_sets=QUICK_OPTIMIZER_SETS,
    p2p_bytes=(4 << 10, 256 << 10, 4 << 20), concurrency_window_s=0.25, jobs=((2, 1),),
    job_runs=1)
