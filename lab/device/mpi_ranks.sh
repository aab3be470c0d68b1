#!/usr/bin/env bash
# One MPI rank against two on the k3-slice (docs/perf.md, "Several ranks (MPI)"): CPU, then
# the GPU on each rank, rounds alternated. DISKS=2 puts each rank in its own cgroup with
# io.max of X bytes/s on the disk under /tmp, so each rank reads from a "disk" of its own and
# two ranks together stay under the disk's own rate. Needs Open MPI's mpirun and a k3 built
# with `--features mpi` (K3=path); output under $OUT (default /tmp/mpi-out).
# Usage: K3=… DISKS=1|2 NGEN=16 X=600000000 bash lab/device/mpi_ranks.sh
set -u
K3=${K3:?set K3 to a k3 built with --features mpi}; M=${M:-/tmp/m}; OUT=${OUT:-/tmp/mpi-out}
DISKS=${DISKS:-1}; X=${X:-600000000}; NGEN=${NGEN:-16}
mkdir -p "$OUT"
export OMPI_MCA_btl_vader_single_copy_mechanism=none
MPI="mpirun --allow-run-as-root --oversubscribe --bind-to none"
[ -f "$M/config.json" ] || $K3 synth --preset k3-slice --layers 4 --experts 256 "$M" >/dev/null || exit 1
WRAP=""
if [ "$DISKS" = 2 ]; then
  CG=/sys/fs/cgroup
  DEV=$(cat /sys/block/$(basename "$(df "$M" | tail -1 | cut -d' ' -f1)")/dev)
  mkdir -p $CG/lead && for p in $(cat $CG/cgroup.procs); do echo "$p" > $CG/lead/cgroup.procs 2>/dev/null; done
  echo +io > $CG/cgroup.subtree_control
  for g in ra rb; do mkdir -p $CG/$g; echo "$DEV rbps=$X" > $CG/$g/io.max; done
  cat > /tmp/inrank.sh <<'S'
#!/bin/sh
g=ra; [ "${OMPI_COMM_WORLD_RANK:-0}" = 1 ] && g=rb
echo $$ > /sys/fs/cgroup/$g/cgroup.procs
exec "$@"
S
  chmod +x /tmp/inrank.sh; WRAP=/tmp/inrank.sh
fi
P="--prompt 'The history of the printing press in Europe' --ngen $NGEN --ignore-eos --expert-gb 2 --direct 1 --no-prompt-cache"
run() { local name=$1 np=$2 be=$3; shift 3
  eval "$MPI -np $np $WRAP $K3 run $M $P --backend $be --stats-json $OUT/$name.json $*" > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo "== $name rc=$?"; grep -E "decode .* tokens|disk:|ranks:" "$OUT/$name.err"; }
for round in 1 2; do run cpu1_r$round 1 cpu; run cpu2_r$round 2 cpu; done
for round in 1 2; do run gpu1_r$round 1 gpu --gpu-expert-gb 2; run gpu2_r$round 2 gpu --gpu-expert-gb 2; done
cmp "$OUT/cpu1_r1.out" "$OUT/cpu2_r1.out" && echo "cpu: same text"
cmp "$OUT/gpu1_r1.out" "$OUT/gpu2_r1.out" && echo "gpu: same text"
