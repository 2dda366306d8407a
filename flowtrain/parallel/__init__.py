"""Process grids for data × pipeline × tensor parallelism."""

from flowtrain.parallel.grid import GridShape, ProcessGrid, build_grid, check_shape

__all__ = ["GridShape", "ProcessGrid", "build_grid", "check_shape"]
