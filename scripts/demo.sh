#!/usr/bin/env bash
# `make demo`: what the simulator predicts for the demo's training run, the run itself, then the
# prediction held against what the run measured (`flowtrain simulate --compare`).
set -euo pipefail

VENV=${VENV:-.venv}
FLOWTRAIN="$VENV/bin/flowtrain"
PYTHON="$VENV/bin/python"
RANKS=2
CONFIG=examples/ds_config_gpt.json
RUN_DIR=${DEMO_RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}

profile=$("$PYTHON" -c 'from sims.hardware import host_profile_path; print(host_profile_path())')
if [ ! -f "$profile" ]; then
  echo "== no profile of this host at $profile yet: measuring it (flowtrain calibrate --quick)"
  "$FLOWTRAIN" calibrate --quick
fi

echo
echo "== predicted: examples/gpt.py:build_demo_model with $CONFIG on $RANKS ranks of this host"
# gpt.py sits in examples/, which is not a package: put it on the path for the factory
PYTHONPATH="examples${PYTHONPATH:+:$PYTHONPATH}" "$FLOWTRAIN" simulate \
  --model gpt:build_demo_model --seq-len 64 --config "$CONFIG" \
  --cluster this-host --devices-per-node "$RANKS"

echo
echo "== training ($RUN_DIR)"
"$FLOWTRAIN" launch --nproc-per-node "$RANKS" --run-dir "$RUN_DIR" examples/train_gpt.py

echo
echo "== measured against predicted"
"$FLOWTRAIN" simulate --compare "$RUN_DIR"
