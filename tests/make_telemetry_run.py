"""Records tests/data/telemetry_run: a real 2-rank launch of telemetry_worker.py (fp16 with a huge
initial loss scale, so the first steps overflow and are skipped) in which rank 1 freezes itself
(SIGSTOP) after step 25 and the coordinator declares it stuck. The monitor's replay tests read
its telemetry.msgpack, job.json and spans/. ``--nproc 4`` records the same story on 4 ranks
(tests/data/telemetry_run4).

Usage: python tests/make_telemetry_run.py [DEST] [--nproc N]   (default: tests/data/telemetry_run,
2 ranks)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import DATA, REPO, child_env


def main() -> int:
    args = sys.argv[1:]
    nproc = "2"
    if "--nproc" in args:
        at = args.index("--nproc")
        nproc = args[at + 1]
        del args[at:at + 2]
    dest = Path(args[0]) if args else DATA / "telemetry_run"
    with tempfile.TemporaryDirectory() as tmp:
        run, out = Path(tmp, "run"), Path(tmp, "out")
        out.mkdir()
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", nproc,
               "--run-dir", str(run), "--total-steps", "30",
               str(DATA / "telemetry_worker.py"), str(out),
               "--steps", "30", "--sleep", "0.1", "--fp16-power", "20", "--stop-after", "25"]
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                              timeout=300)
        if proc.returncode == 0:
            print("the job was expected to fail (rank 1 stuck) but succeeded", file=sys.stderr)
            return 1
        if dest.exists():
            shutil.rmtree(dest)
        (dest / "spans").mkdir(parents=True)
        shutil.copy(run / "telemetry.msgpack", dest / "telemetry.msgpack")
        shutil.copy(run / "job.json", dest / "job.json")
        for spans in (run / "spans").glob("rank*.jsonl"):
            shutil.copy(spans, dest / "spans" / spans.name)
    print(f"recorded {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
