# Sourced by the decode scripts: the k3 binary, the k3slice32 model (k3-slice dimensions,
# 4 layers, 32 experts a MoE layer; synthesized on the device's disk when it is not there)
# and the prompt ids they run.
K=./.devbin/k3
M=/tmp/k3slice32
[ -f "$M/config.json" ] || "$K" synth --preset k3-slice --layers 4 --experts 32 "$M" > "$OUT/synth32.txt" 2>&1
IDS=$(seq -s, 1000 97 2000)
