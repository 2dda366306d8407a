"""DeepSpeed's ``--launcher slurm|openmpi|mpich|impi|mvapich``: the ranks started as the tasks
of one ``srun`` (or MPI ``mpirun``/``mpiexec``) command instead of by flowtrain itself. The
launcher still hosts the control plane; each task learns its rank from the task launcher's
own variables (``apply_task_env``, run first thing by the rank bootstrap) and the rest (the
control endpoint, the job secret, the run directory) from the environment the task launcher
passes on. The secret travels in the environment only, never on a command line."""

from __future__ import annotations

import os
import shutil
from collections.abc import MutableMapping, Sequence

from flowtrain import env as fenv
from flowtrain.launch.hostfile import LaunchInputError
from flowtrain.slurm import apply as slurm_apply

TASK_LAUNCHER = "FLOWTRAIN_TASK_LAUNCHER"  # set for the tasks: whose variables to read
# the command each launcher name runs
COMMANDS = {"slurm": "srun", "openmpi": "mpirun", "mpich": "mpiexec", "impi": "mpiexec",
            "mvapich": "mpiexec"}
# each MPI's rank, world size, local rank and local size variables (Open MPI's, then the PMI
# ones MPICH's Hydra, Intel MPI and MVAPICH2 set)
_MPI_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE"),
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
             ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
              "MV2_COMM_WORLD_LOCAL_SIZE"))
# what the launcher hands every task by name (Open MPI's -x forwards only the variables named)
_FORWARD_PREFIXES = ("FLOWTRAIN_", "MASTER_", "TORCHELASTIC_", "NCCL_", "PYTHON", "OMP_",
                     "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")


def find_command(name: str) -> str:
    """The task launcher's executable for ``--launcher name``, or a one-line error."""
    command = COMMANDS[name]
    found = shutil.which(command)
    if found is None:
        raise LaunchInputError(f"--launcher {name} runs '{command}', which is not on PATH; "
                               f"install it or use flowtrain's own launch (--hostfile over ssh)")
    return found


def task_command(name: str, executable: str, *, nnodes: int, nproc_per_node: int,
                 hosts: Sequence[str], launcher_args: Sequence[str],
                 env: MutableMapping[str, str], rank_argv: Sequence[str]) -> list[str]:
    """The command line that starts every rank as a task: ``rank_argv`` (the rank bootstrap
    and the script) under ``name``'s launcher, ``nnodes`` x ``nproc_per_node`` tasks, on
    ``hosts`` when given."""
    world = nnodes * nproc_per_node
    if name == "slurm":
        cmd = [executable, f"--nodes={nnodes}", f"--ntasks-per-node={nproc_per_node}",
               f"--ntasks={world}", "--export=ALL"]
        if hosts:
            cmd.append(f"--nodelist={','.join(hosts)}")
    elif name == "openmpi":
        cmd = [executable, "-n", str(world), "--npernode", str(nproc_per_node)]
        if hosts:
            cmd += ["--host", ",".join(f"{h}:{nproc_per_node}" for h in hosts)]
        for key in sorted(env):
            if key.startswith(_FORWARD_PREFIXES):
                cmd += ["-x", key]  # the name only: the value stays in the environment
    else:  # Hydra's mpiexec (MPICH, Intel MPI, MVAPICH2)
        cmd = [executable, "-n", str(world), "-ppn", str(nproc_per_node), "-genvall"]
        if hosts:
            cmd += ["-hosts", ",".join(hosts)]
    return [*cmd, *launcher_args, *rank_argv]


def apply_task_env(environ: MutableMapping[str, str] | None = None) -> bool:
    """In a task started by a task launcher (``TASK_LAUNCHER`` set, ``RANK`` not): the torch
    variables from the launcher's own, and this rank's error file in the run directory.
    Returns whether it did."""
    env = os.environ if environ is None else environ
    if TASK_LAUNCHER not in env or fenv.RANK in env:
        return False
    if env[TASK_LAUNCHER] == "slurm":
        if not slurm_apply(env):
            raise RuntimeError(f"{TASK_LAUNCHER}=slurm, but SLURM_PROCID and SLURM_NTASKS "
                               f"are not set: was this task started by srun?")
    else:
        for rank_var, size_var, local_var, local_size_var in _MPI_VARS:
            if rank_var in env and size_var in env:
                env[fenv.RANK], env[fenv.WORLD_SIZE] = env[rank_var], env[size_var]
                env[fenv.LOCAL_RANK] = env.get(local_var, "0")
                env[fenv.LOCAL_WORLD_SIZE] = env.get(local_size_var, "1")
                break
        else:
            raise RuntimeError(f"{TASK_LAUNCHER}={env[TASK_LAUNCHER]}, but none of the MPI "
                               f"rank variables is set ({', '.join(v[0] for v in _MPI_VARS)})")
    rank = int(env[fenv.RANK])
    local_world = max(1, int(env.get(fenv.LOCAL_WORLD_SIZE, "1") or 1))
    env.setdefault(fenv.GROUP_RANK, env.get("SLURM_NODEID", str(rank // local_world)))
    run_dir = env.get(fenv.RUN_DIR)
    if run_dir:
        env.setdefault(fenv.ERROR_FILE, os.path.join(run_dir, f"rank{rank}.error.json"))
    return True
