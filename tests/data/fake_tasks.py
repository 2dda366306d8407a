"""Stand-in for SLURM's ``srun`` and Open MPI's ``mpirun`` in the launcher tests:
``fake_tasks.py srun|mpirun ARGS... COMMAND...`` starts the tasks on this machine with the
variables the real one gives each task, waits for them, and exits with the first failure's
code. As Open MPI does for remote hosts, the mpirun stand-in passes a task only the variables
named with ``-x`` (and PATH, HOME); srun's ``--export=ALL`` passes everything. The arguments
it was given are written to $FAKE_TASKS_ARGS when that is set."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def _parse(kind: str, args: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    opts: dict[str, str] = {}
    names: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-"):
        arg = args[i]
        if "=" in arg:
            key, value = arg.split("=", 1)
            opts[key] = value
        elif kind == "mpirun" and arg == "-x":
            names.append(args[i + 1])
            i += 1
        elif kind == "mpirun" and arg in ("-n", "--npernode", "--host"):
            opts[arg] = args[i + 1]
            i += 1
        else:
            opts[arg] = ""
        i += 1
    return opts, names, args[i:]


def main() -> int:
    kind, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("FAKE_TASKS_ARGS"):
        with open(os.environ["FAKE_TASKS_ARGS"], "w") as f:
            f.write("\n".join(args))
    opts, names, command = _parse(kind, args)
    if kind == "srun":
        world, per_node = int(opts["--ntasks"]), int(opts["--ntasks-per-node"])
    else:
        world, per_node = int(opts["-n"]), int(opts["--npernode"])
    procs = []
    for task in range(world):
        if kind == "srun":
            env = dict(os.environ)
            env.update(SLURM_PROCID=str(task), SLURM_NTASKS=str(world),
                       SLURM_LOCALID=str(task % per_node), SLURM_NODEID=str(task // per_node),
                       SLURM_NTASKS_PER_NODE=str(per_node), SLURM_JOB_NODELIST="localhost",
                       SLURM_JOB_ID="4242")
        else:
            env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
            env.update({n: os.environ[n] for n in names if n in os.environ})
            env.update(OMPI_COMM_WORLD_RANK=str(task), OMPI_COMM_WORLD_SIZE=str(world),
                       OMPI_COMM_WORLD_LOCAL_RANK=str(task % per_node),
                       OMPI_COMM_WORLD_LOCAL_SIZE=str(per_node))
        procs.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
