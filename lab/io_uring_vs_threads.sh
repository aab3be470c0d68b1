#!/usr/bin/env bash
# Does io_uring read a disk faster than threads doing pread at the same queue depth? fio
# random O_DIRECT reads of one file, alternated over ROUNDS rounds: 4 threads of blocking
# pread (what the loader pool does: 4 threads, one read each in flight) against one
# io_uring (and one libaio) submitter holding 4 reads in flight, at the read sizes of a
# whole K3 expert (16 MiB, about 17.5 MB) and of pieces (4, 2, 1 MiB), plus depth 8 and 16
# of 2 MiB and 1 MiB pieces for both. Needs fio; it builds nothing.
#
#   usage: bash lab/io_uring_vs_threads.sh FILE [ROUNDS] [SECONDS]
#
# FILE: a large file on the disk under test (an expert shard: `k3 synth --preset k3-slice
# --layers 4 --experts 64 DIR` writes 13.7 GB); SECONDS (5) each case runs.
set -eu
f=$1
rounds=${2:-2}
secs=${3:-5}
command -v fio > /dev/null || { echo "fio is not installed"; exit 1; }
cases=(
    "psync 4 1 16m" "io_uring 1 4 16m"
    "psync 4 1 2m" "io_uring 1 4 2m" "libaio 1 4 2m"
    "psync 4 1 4m" "io_uring 1 4 4m"
    "psync 8 1 2m" "io_uring 1 8 2m"
    "psync 16 1 1m" "io_uring 1 16 1m"
)
echo "file $f, $secs s a case, $rounds rounds; jobs x depth = reads in flight"
for r in $(seq 1 "$rounds"); do
    for c in "${cases[@]}"; do
        set -- $c
        bw=$(fio --name=x --filename="$f" --rw=randread --direct=1 --ioengine="$1" --numjobs="$2" \
            --iodepth="$3" --bs="$4" --runtime="$secs" --time_based --group_reporting --thread \
            --output-format=terse | tail -1 | cut -d';' -f7)
        printf "round %s  %-8s jobs %-2s depth %-2s bs %-4s %6d MB/s\n" "$r" "$1" "$2" "$3" "$4" $((bw / 1024))
    done
done
