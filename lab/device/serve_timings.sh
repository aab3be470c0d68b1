#!/bin/bash
# Where a served token's time goes on the device box: k3 serve on k3slice32 resident, one
# 64-token chat greedy and one at temperature 1, each request's `timings` (prefill, decode,
# pick) against `k3 bench streams` one stream's pass time in the same call. Binary: $K.
for f in .gl/*.deb; do dpkg -x $f / >/dev/null; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
K=${K:-./.devbin/k3}; M=/tmp/k3slice32
[ -f "$M/config.json" ] || timeout 60 "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" >/dev/null 2>&1
timeout 100 "$K" bench streams "$M" --backend gpu --expert-gb 8 --gpu-expert-gb 8 --ngen 32 \
    --streams 1 --rounds 2 2>&1 | grep -E "^\| [0-9]"
"$K" serve "$M" --backend gpu --expert-gb 8 --gpu-expert-gb 8 --port 8391 ${FLAGS:-} > /tmp/serve.log 2>&1 &
S=$!
for i in $(seq 1 120); do curl -s localhost:8391/health >/dev/null && break; sleep 0.5; done
for t in 0 1 0 1; do
    curl -s localhost:8391/v1/chat/completions -H 'Content-Type: application/json' -d \
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell a story\"}],\"max_tokens\":64,\"ignore_eos\":true,\"temperature\":$t,\"seed\":1}" \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print('temperature $t', d['usage'], d.get('timings'))"
done
kill $S; grep -E "serve .*prompt" /tmp/serve.log | tail -4
