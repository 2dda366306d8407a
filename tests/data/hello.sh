#!/usr/bin/env bash
# A non-Python rank for --no-python: prints its place in the job.
echo "shell rank $RANK of $WORLD_SIZE args $*"
