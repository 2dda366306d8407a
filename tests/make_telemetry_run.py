"""Records tests/data/telemetry_run: a real 2-rank launch of telemetry_worker.py (fp16 with a huge
initial loss scale, so the first steps overflow and are skipped) in which rank 1 freezes itself
(SIGSTOP) after step 25 and the coordinator declares it stuck. The monitor's replay tests read
its telemetry.msgpack, job.json and spans/.

Usage: python tests/make_telemetry_run.py [DEST]   (default: tests/data/telemetry_run)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import DATA, REPO, child_env


def main() -> int:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else DATA / "telemetry_run"
    with tempfile.TemporaryDirectory() as tmp:
        run, out = Path(tmp, "run"), Path(tmp, "out")
        out.mkdir()
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", "2",
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
