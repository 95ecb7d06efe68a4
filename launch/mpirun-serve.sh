#!/usr/bin/env bash
# Serve a model with N ranks on this node through mpiexec (MPICH) or mpirun (Open MPI).
#
#   launch/mpirun-serve.sh -n N --model DIR [--port P | --control tcp://HOST:PORT]
#                          [--endpoint-file FILE] [--backend cpu|cuda|auto] [--bind cores|numa|none]
#                          [--max-seq N] [--http-port P [--http-host H]] [-- more kog-worker arguments]
#
# - The launcher is the one on PATH (`kog launch --launcher mpi` tells MPICH from Open MPI by its
#   --version): MPICH gets `-n N -bind-to none`; Open MPI gets `-np N --bind-to none`, plus
#   `--allow-run-as-root` only as root and `--oversubscribe` only when N exceeds the cores.
#   KOG_LAUNCHER=mpich|openmpi forces one.
# - The launcher binds nothing: each rank binds itself to the cores and memory the topology plan
#   gives it (kog-worker --bind, default cores; `kog topo --ranks N` shows the plan first).
# - Rank 0 serves the control plane on --control (default tcp://127.0.0.1:PORT, PORT from --port,
#   KOG_PORT, or a free one). Once it listens the endpoint is printed and written to
#   --endpoint-file (default: none); `kog client --connect $(cat FILE) generate ...` talks to it.
# - --http-port P also runs the OpenAI-compatible gateway, `kog serve --connect CONTROL --port P`
#   (--http-host H, default 127.0.0.1; a non-loopback H needs KOG_API_KEY), stopped with the ranks.
# - Ctrl-C / SIGTERM reach every rank through the launcher; the exit code is the launcher's.
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

PY=${KOG_PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Run from a checkout without installing: make the repository importable.
if [ -f "$HERE/cli.py" ] && [ -d "$HERE/../kog_dist" ]; then
  export PYTHONPATH="$(cd "$HERE/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi

NP="" MODEL="" PORT=${KOG_PORT:-} CONTROL="" EPFILE="" BIND=cores HTTP_PORT="" HTTP_HOST=127.0.0.1
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n|-np|--np) NP=$2; shift 2;;
    --model) MODEL=$2; shift 2;;
    --port) PORT=$2; shift 2;;
    --control) CONTROL=$2; shift 2;;
    --endpoint-file) EPFILE=$2; shift 2;;
    --bind) BIND=$2; shift 2;;
    --http-port) HTTP_PORT=$2; shift 2;;
    --http-host) HTTP_HOST=$2; shift 2;;
    -h|--help) usage; exit 0;;
    --) shift; EXTRA+=("$@"); break;;
    *) EXTRA+=("$1"); shift;;
  esac
done
[ -n "$NP" ] || { echo "mpirun-serve.sh: -n N is required" >&2; usage >&2; exit 2; }
[ -n "$MODEL" ] || { echo "mpirun-serve.sh: --model DIR is required" >&2; exit 2; }
case "$NP" in ''|*[!0-9]*|0) echo "mpirun-serve.sh: -n wants a positive integer, got '$NP'" >&2; exit 2;; esac

if [ -z "$CONTROL" ]; then
  [ -n "$PORT" ] || PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  CONTROL="tcp://127.0.0.1:$PORT"
fi

# absolute paths: Open MPI starts the ranks with its own prefix's bin first on PATH (Debian's mpirun: /usr/bin),
# where `python3` can be another Python than ours (the GPU machine's: no numpy)
PY=$(command -v "$PY" || echo "$PY")
if command -v kog-worker >/dev/null 2>&1; then WORKER=("$(command -v kog-worker)"); else WORKER=("$PY" -m workers); fi
[ -n "${KOG_WORKER:-}" ] && read -r -a WORKER <<<"$KOG_WORKER"

# The plan the ranks will bind to (informational; the ranks compute it themselves).
if [ "$BIND" != none ]; then
  timeout 60 "$PY" -m topology.cli --ranks "$NP" >&2 2>/dev/null || true
fi

# --keep-survivors: a dead rank reaches the clients as backend_failed, not as a lost server
LARGS=(--launcher "${KOG_LAUNCHER:-mpi}" --np "$NP" --keep-survivors)
[ -n "$EPFILE" ] && LARGS+=(--endpoint-file "$EPFILE")
echo "mpirun-serve.sh: $NP ranks, model $MODEL, control $CONTROL, bind $BIND" >&2
if [ -z "$HTTP_PORT" ]; then
  exec "$PY" -m launch.cli "${LARGS[@]}" -- "${WORKER[@]}" --model "$MODEL" --control "$CONTROL" \
    --bind "$BIND" "${EXTRA[@]}"
fi
"$PY" -m launch.cli "${LARGS[@]}" -- "${WORKER[@]}" --model "$MODEL" --control "$CONTROL" \
  --bind "$BIND" "${EXTRA[@]}" &
ranks=$!
"$PY" -m kog_cli serve --connect "$CONTROL" --host "$HTTP_HOST" --port "$HTTP_PORT" \
  --served-model-name "$(basename "${MODEL%.gguf}")" &
gateway=$!
trap 'kill -TERM $gateway $ranks 2>/dev/null || true' TERM INT
# the ranks decide the exit code; the gateway goes when they go
while kill -0 "$ranks" 2>/dev/null; do wait "$ranks" || true; done
rc=0; wait "$ranks" || rc=$?
kill -TERM "$gateway" 2>/dev/null || true
wait "$gateway" 2>/dev/null || true
exit "$rc"
