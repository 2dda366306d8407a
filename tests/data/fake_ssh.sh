#!/usr/bin/env bash
# Stand-in for ssh in the launcher tests: `fake_ssh.sh HOST COMMAND...` runs COMMAND with bash on
# this machine, as `ssh HOST COMMAND` would on HOST.
host="$1"
shift
exec bash -c "$*"
