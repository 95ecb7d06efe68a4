#!/bin/bash
# End-to-end check on a GPU machine: the cuda backend gives the cpu backend's ids for kog generate and
# through kog-worker + the control plane (generate, stream, session), and SIGTERM ends the server with 0.
# From the repo root, with pyzmq wheels in .whl (../shared/tools/device-wheels.sh); logs under $OUT.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
K="python3 -m kog_cli"
$K checkpoint tiny /tmp/m --lanes 8 --layers 4 --heads 16 --kv-heads 8 --hidden 256 --ffn 512 --delay 2 --window 16 --window-layers 2
$K generate --model /tmp/m --backend cpu --prompt-ids 1,5,9,40 -n 48 --json > ${OUT:-/tmp}/cpu.json
$K generate --model /tmp/m --backend cuda --prompt-ids 1,5,9,40 -n 48 --json > ${OUT:-/tmp}/cuda.json
python3 -c "
import json; a=json.load(open('${OUT:-/tmp}/cpu.json')); b=json.load(open('${OUT:-/tmp}/cuda.json'))
print('CPU ', a['token_ids'][:16]); print('CUDA', b['token_ids'][:16]); print('EQUAL', a['token_ids']==b['token_ids'], b['backend'], b['stats'])"
python3 -m workers --model /tmp/m --backend cuda --bind none --control tcp://127.0.0.1:5555 > ${OUT:-/tmp}/serve.log 2>&1 &
W=$!
for i in $(seq 1 60); do $K client --connect tcp://127.0.0.1:5555 health >/dev/null 2>&1 && break; sleep 0.5; done
$K client --connect tcp://127.0.0.1:5555 generate --prompt-ids 1,5,9,40 -n 48 --json > ${OUT:-/tmp}/served.json
python3 -c "
import json; a=json.load(open('${OUT:-/tmp}/cpu.json')); b=json.load(open('${OUT:-/tmp}/served.json')); print('SERVED EQUAL', a['token_ids']==b['token_ids'], b['stats'])"
python3 - <<'PY'
import time
from kog_dist import Client
with Client("tcp://127.0.0.1:5555") as c:
    t0=time.perf_counter(); times=[]
    for ch in c.stream(prompt_ids=[1,5,9,40], max_new_tokens=200):
        times.append(time.perf_counter()-t0)
    print("STREAM chunks", len(times), "first at %.2f ms, last at %.2f ms" % (1e3*times[0], 1e3*times[-1]))
    s = c.session(); s.append(prompt_ids=[1,5,9,40]); r1 = s.generate(max_new_tokens=8); s.append(prompt_ids=[7,7]); r2 = s.generate(max_new_tokens=8)
    print("SESSION", r1.token_ids, r2.token_ids, r2.stats.get("prefill_tokens"), r2.stats.get("reused_tokens"))
PY
kill -TERM $W; wait $W; echo "serve rc=$?"; tail -5 ${OUT:-/tmp}/serve.log
