#!/usr/bin/env bash
# The GPU runs the open issues wait on, each sized for one device call (under 10 minutes);
# results go to docs/performance.md. On a machine without network, first `bash
# scripts/gpu_install.sh` (README: "A GPU machine without network").
#
#   bash benchmarks/gpu_runs.sh tests     # tests/gpu: engine, sync, jobs (two GPUs: ~8 min); SFT weights kept
#   bash benchmarks/gpu_runs.sh cpusuite  # the CPU suite (GPUs hidden), two threads a process (needs numpy 2.3.5;
#                                         # CPUSUITE_S: its time limit, 540 s)
#   bash benchmarks/gpu_runs.sh sync      # weight sync at 1b by CUDA IPC and NCCL, with the parts (two GPUs)
#   bash benchmarks/gpu_runs.sh engine    # the FP8, expert kernel and engine tests; decode at 1b: bf16, FP8; its profile
#   bash benchmarks/gpu_runs.sh chunked   # the engine's GPU tests (chunked prefill among them); a long prompt's stall, whole vs chunked
#   bash benchmarks/gpu_runs.sh replay    # the replay table on the GPU DAPO job (after `tests`)
#   bash benchmarks/gpu_runs.sh trainer   # miles sft against the trainer alone and in a Ray actor; flash_slice
#   bash benchmarks/gpu_runs.sh layouts   # flash_slice on one GPU, EP=4 (reduction after / overlapped), TP=2 x EP=2 (4 GPUs)
#   bash benchmarks/gpu_runs.sh layouts2  # the same on two GPUs: one GPU, EP=2 (reduction after / overlapped), TP=2
#   bash benchmarks/gpu_runs.sh head      # flash_slice: the heads' backward options, and 4 micro-batches a step
#   bash benchmarks/gpu_runs.sh moments   # flash_slice: AdamW's moments in bf16, alone and with the head's options
#   bash benchmarks/gpu_runs.sh wgrad     # the expert wgrad kernel: its tests, its tiles at flash_slice's shapes, the step A/B
#   bash benchmarks/gpu_runs.sh embedding # flash_slice: the embedding's gradient by rows vs dense, and the step with all options
#   bash benchmarks/gpu_runs.sh headwgrad # the head tests; flash_slice: the heads' weight gradient per chunk vs gathered
#   bash benchmarks/gpu_runs.sh mfu       # the mixes tests; flash_slice's MFU goal row: 16 and 8 micro-batches a step
#                                         # (the --mixes-dx A/B: its default arm is the goal's number)
#
# Logs go to $OUT (the device tool's folder) or ./gpu-logs; the last lines of each show here.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 MILES_TEST_GPU=1
logs="${OUT:-gpu-logs}"
mkdir -p "$logs"
keep=/tmp/miles-gpu-runs  # the SFT test's run (its hf/ starts the replay table)

run() {  # NAME SECONDS COMMAND...: the command under a time limit, its log kept, its tail shown
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    (time timeout "$limit" "$@") > "$logs/$name.log" 2>&1
    grep -v "Warning\|warnings.warn\|^\s*if hasattr\|^\s*return func\|^(" "$logs/$name.log" | tail -"${TAIL:-16}"
}

case "${1:-}" in
tests)
    run engine-tests 200 python3 -m pytest -q tests/gpu/test_sync_gpu.py tests/gpu/test_engine_gpu.py -p no:cacheprovider
    run job-tests 380 python3 -m pytest -q -x tests/gpu/test_jobs_gpu.py --basetemp="$keep" -p no:cacheprovider
    ;;
cpusuite)
    # torch takes a thread a core in every test process and rank; two each. With a file a
    # worker (--dist loadfile) test_rl.py ran over 535 s on one (358 s on CI): it gets three
    # workers of its own, a test each at a time.
    workers=$(( $(nproc) / 2 - 5 ))
    workers=$(( workers > 11 ? 11 : (workers < 2 ? 2 : workers) ))
    export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 CUDA_VISIBLE_DEVICES=
    limit=${CPUSUITE_S:-540}
    TAIL=3 run cpu-suite-rl "$limit" python3 -m pytest tests/test_rl.py -n 3 --dist load -v -p no:cacheprovider \
        --junitxml="$logs/cpu-suite-rl.xml" &
    TAIL=40 run cpu-suite "$limit" python3 -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder -v \
        -p no:cacheprovider --ignore=tests/test_rl.py --junitxml="$logs/cpu-suite.xml"
    wait
    cat "$logs"/cpu-suite*.log | grep -c " PASSED "
    ;;
sync)
    run sync 300 python3 benchmarks/rollout.py --configs 1b --sync-only --paths shared broadcast
    run fingerprint 60 python3 benchmarks/fingerprint.py
    ;;
engine)
    run fp8-tests 200 python3 -m pytest -q tests/test_kernels.py -k "fp8 or expert" tests/gpu/test_engine_gpu.py -p no:cacheprovider
    run decode-bf16 200 python3 benchmarks/rollout.py --configs 1b --batches 1 16 64
    run decode-fp8 200 python3 benchmarks/rollout.py --configs 1b --batches 1 16 64 --kv-quant fp8
    run decode-profile 150 python3 benchmarks/decode_profile.py
    ;;
chunked)
    run chunked-tests 300 python3 -m pytest -q tests/gpu/test_engine_gpu.py -p no:cacheprovider
    run chunked-prefill 240 python3 benchmarks/chunked_prefill.py --config 1b --running 32 --long 3584 --chunks 512 2048 --profile
    ;;
replay)
    run replay 400 python3 benchmarks/replay.py --job jobs/dapo_gpu.yaml --hf "$keep/sft0/hf" --steps 4
    ;;
trainer)
    run sft 240 python3 benchmarks/sft_gpu.py
    run flash 300 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 2 --steps 4
    ;;
head)
    run head-ab 330 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 2 --steps 4 --ab --head-backward
    run flash-4mb 200 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 4 --steps 4
    ;;
moments)
    run moments-ab 330 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 2 --steps 4 --ab --moments
    ;;
wgrad)
    run wgrad-tests 200 python3 -m pytest -q tests/test_kernels.py -k "wgrad or grouped" -p no:cacheprovider
    run wgrad-tiles 200 python3 benchmarks/moe_gpu.py --tokens 4096 --experts 8 --topk 6 --hidden 4096 --inter 2048
    run wgrad-ab 300 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 2 --steps 4 --ab --wgrad-tiles
    ;;
embedding)
    run embedding-tests 120 python3 -m pytest -q tests/test_ops.py -k embedding -p no:cacheprovider
    run embedding-ab 300 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 2 --steps 4 --ab --embedding --moments
    ;;
headwgrad)
    run head-tests 200 python3 -m pytest -q tests/test_kernels.py -k "head or split" -p no:cacheprovider
    run head-wgrad-ab 330 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 2 --steps 4 --ab --head-wgrad
    ;;
mfu)
    run mixes-tests 120 python3 -m pytest -q tests/test_kernels.py -k "mixes or hc_ or pre_streams" -p no:cacheprovider
    run mfu-16 220 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 16 --steps 3 --ab --mixes-dx
    run mfu-8 170 python3 benchmarks/train_gpu.py --config flash_slice --seq 4096 --batch 8 --steps 3 --ab --mixes-dx
    ;;
layouts)
    run layouts 560 python3 benchmarks/layouts_gpu.py --layouts 1 ep4-sync ep4 tp2ep2 --profile --groups --stall-after 240
    ;;
layouts2)
    run layouts2 560 python3 benchmarks/layouts_gpu.py --layouts 1 ep2-sync ep2 tp2 --profile --stall-after 200
    ;;
*)
    sed -n '2,/^# Logs/p' "$0"
    exit 2
    ;;
esac
