#!/usr/bin/env bash
# Run an omnishm committer in the foreground (for a supervisor: systemd, supervisord, k8s).
#
# Usage: scripts/launch_committer.sh --name NAME [--config FILE] [--runtime-dir DIR]
#                                    [--endpoint ipc://...|tcp://127.0.0.1:PORT]
#                                    [--heartbeat-s S] [--heartbeat-timeout-s S] [--exit-when-idle]
#                                    [--prefault] [--metrics-port PORT] [--metrics-host HOST]
#                                    [--log-level LEVEL] [--nontemporal-threshold BYTES] [--exit-with-parent]
#                                    (--no-exit-when-idle, --no-prefault: off)
# Every option is also an OMNISHM_<OPTION> variable or a TOML key (see README, Configuration);
# `scripts/launch_committer.sh --help` lists them with their defaults.
#
# SIGTERM, SIGINT, SIGHUP (unless started under nohup) and SIGQUIT stop it cleanly (every segment unlinked, exit 0),
# from the moment the interpreter runs (0.1-0.3 s after the exec, more on a loaded host; a signal before that ends it
# by the default action, exit 128+N, having made nothing). Exit 2: another committer already holds that cache name.
# --exit-with-parent: it stops the same way once the process that ran this script is gone (a supervisor that died
# with SIGKILL, say), instead of keeping the cache's segments until someone stops it; a shell that starts this script
# as its child adds --parent-pid $$ (its own pid), so that it is caught also when gone while the interpreter starts.
# PYTHON overrides the interpreter (default python3).
set -euo pipefail
exec "${PYTHON:-python3}" -m omnishm.committer "$@"
