#!/usr/bin/env bash
# The GPU path, in one call of a few minutes: what docs/gpu.md reports.
#   bash tools/gpu/check.sh [OUT_DIR]      # default: $OUT, else /tmp/commbench-gpu-check
#   PARTS="one ranks" bash tools/gpu/check.sh OUT_DIR   # both parts (default: one per call)
# Two parts: "one" (one GPU, below) and "ranks" (2+ GPUs, after it). PARTS defaults to
# "one" on a node with one GPU and to "ranks" on a node with more, so that one call stays
# under ~8 minutes; BUDGET_S (default 420) bounds the ranks part's runs: past it, the
# runs left are skipped and say so.
# Runs from the repository root with the machine's own CUDA build of torch (PYTHONPATH,
# no install; wheels under .whl/ for commbench's small pure-Python dependencies are
# installed into /tmp/site first when present). Checks: doctor's one-GPU checks (CUDA
# events against the host clock, bf16 autocast), then short runs through the real
# launcher on one rank (NCCL at world size 1): DDP fp32 / bf16 / bf16 + compile, DiLoCo
# bf16, checkpoint then --resume, a Llama "small" at seq 1024 eager and compiled for
# throughput and MFU, and short runs of GPT-2 small in bf16 and Llama small in fp32 and
# with activation checkpointing for memory against the plan. Prints a table of the runs
# last. About 5 minutes on an H100.
# The ranks part, on every GPU of the node (up to 8; the pipelines on an even count):
# `commbench doctor` across them (its report in OUT_DIR/doctor-report.md), then short runs
# of a tiny GPT in bf16 of every strategy family across the ranks: DDP, DiLoCo, Pier,
# GASLoC, streaming DiLoCo, torch 1F1B (2 stages), PipeDream-2BW, DDP + FSDP2, DeepSpeed
# ZeRO-1 (skipped, saying so, without deepspeed), printing one table (tools/gpu/ranks.py:
# run, ranks, status, tok/s, exposed comm s, bytes sent, val loss).
set -u
out=${1:-${OUT:-/tmp/commbench-gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
runs=/tmp/commbench-gpu-runs
rm -rf "$runs"; mkdir -p "$runs"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
    "NCCL", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))'
gpus=$(nvidia-smi -L | wc -l)
parts=${PARTS:-$([ "$gpus" -ge 2 ] && echo ranks || echo one)}
echo "$gpus GPUs; parts: $parts"

if [[ " $parts " == *" one "* ]]; then

echo "== doctor's one-GPU checks"
python3 - "$runs/doctor" <<'PY'
import sys
from pathlib import Path
from bench.node import doctor
ctx = doctor.Context(world_size=1, gpus=1, work_dir=Path(sys.argv[1]))
wanted = {"environment", "CUDA events vs host timing", "bf16 autocast"}
doctor.run_checks([c for c in doctor.CHECKS if c.name in wanted], ctx, echo=print)
PY

one() {  # NAME CONFIG [--set ...]: one rank on the GPU, its log kept
    local name=$1 config=$2; shift 2
    echo "== run $name"
    timeout "${RUN_TIMEOUT:-150}" python3 -m bench.cli run "$config" --run-dir "$runs/$name" \
        --set parallel.world_size=1 --set parallel.device=auto --set parallel.backend=auto \
        --set "network.profiles=[nvlink]" --set checkpoint.final=false "$@" \
        > "$runs/$name.log" 2>&1
    echo "rc=$? $(tail -n 2 "$runs/$name.log" | tr '\n' ' ' | cut -c1-300)"
    python3 tools/gpu/table.py "$runs/$name"
}
tiny=(--set run.steps=40 --set run.log_every=10 --set run.val_every=20 --set run.warmup_steps=3)
one ddp-fp32 configs/ddp-tiny.yaml "${tiny[@]}"
one ddp-bf16 configs/ddp-tiny.yaml "${tiny[@]}" --set model.precision=bf16
one ddp-bf16-compile configs/ddp-tiny.yaml "${tiny[@]}" --set model.precision=bf16 \
    --set model.compile=true
one diloco-bf16 configs/diloco-tiny.yaml "${tiny[@]}" --set model.precision=bf16 \
    --set strategy.inner_steps=5
one resume-first configs/ddp-tiny.yaml --set run.steps=6 --set checkpoint.every=2 \
    --set run.val_every=0 --set run.log_every=1
echo "== resume to 10 steps"
timeout 150 python3 -m bench.cli run --resume "$runs/resume-first" \
    --set run.steps=10 > "$runs/resume.log" 2>&1
echo "rc=$? $(tail -n 2 "$runs/resume.log" | tr '\n' ' ' | cut -c1-300)"
grep -h resumed_from_step "$runs/resume-first/summary.json"
small=(--set model.preset=small --set model.seq_len=1024 --set data.batch_size=16
       --set run.val_every=0 --set run.val_sequences=8 --set optim.lr=6e-4
       --set checkpoint.every=0)  # the embedded corpus holds 24 validation windows of 1025
big=("${small[@]}" --set model.arch=llama --set model.precision=bf16 --set run.steps=40
     --set run.log_every=10 --set run.warmup_steps=10)
RUN_TIMEOUT=200 one llama-small-bf16 configs/ddp-tiny.yaml "${big[@]}"
RUN_TIMEOUT=200 one llama-small-bf16-compile configs/ddp-tiny.yaml "${big[@]}" \
    --set model.compile=true
# the memory plan against the peak: another architecture, fp32, activation checkpointing
plan=("${small[@]}" --set run.steps=12 --set run.log_every=4 --set run.warmup_steps=4)
one gpt2-small-bf16 configs/ddp-tiny.yaml "${plan[@]}" --set model.arch=gpt2 \
    --set model.precision=bf16
one llama-small-fp32 configs/ddp-tiny.yaml "${plan[@]}" --set model.arch=llama \
    --set model.precision=fp32
one llama-small-bf16-checkpointing configs/ddp-tiny.yaml "${plan[@]}" --set model.arch=llama \
    --set model.precision=bf16 --set model.activation_checkpointing=blocks

echo "== runs"
python3 tools/gpu/table.py --header "$runs"/*/
fi  # the one-GPU part

if [[ " $parts " == *" ranks "* ]] && [ "$gpus" -lt 2 ]; then
    echo "== ranks: skipped, the node has $gpus GPU(s)"
elif [[ " $parts " == *" ranks "* ]]; then
    world=$((gpus > 8 ? 8 : gpus))
    pipe=$((world - world % 2))
    deadline=$((SECONDS + ${BUDGET_S:-420}))
    echo "== doctor across $world GPUs"
    timeout 300 python3 -m bench.cli doctor --world-size "$world" --out "$out/doctor-report.md" \
        --keep "$runs/doctor-ranks" > "$runs/doctor-ranks.log" 2>&1
    echo "rc=$?"
    grep -E '^\| |passed' "$runs/doctor-ranks.log"
    mkdir -p "$runs/ranks"
    order=()
    many() {  # NAME CONFIG RANKS [--set ...]: one short run across RANKS GPUs, its log kept
        local name=$1 config=$2 ranks=$3; shift 3
        order+=("$runs/ranks/$name")
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "past BUDGET_S (${BUDGET_S:-420} s)" > "$runs/ranks/$name.skipped"; return
        fi
        echo "== run $name on $ranks ranks"
        timeout "${RUN_TIMEOUT:-120}" python3 -m bench.cli run "$config" \
            --run-dir "$runs/ranks/$name" --set parallel.world_size="$ranks" \
            --set parallel.device=auto --set parallel.backend=auto \
            --set "network.profiles=[nvlink]" --set checkpoint.final=false --set run.steps=30 \
            --set run.log_every=10 --set run.val_every=0 --set run.val_sequences=8 \
            --set run.warmup_steps=3 --set model.precision=bf16 "$@" > "$runs/ranks/$name.log" 2>&1
        echo "rc=$? $(tail -n 1 "$runs/ranks/$name.log" | cut -c1-200)"
    }
    many ddp configs/ddp-tiny.yaml "$world"
    many diloco configs/diloco-tiny.yaml "$world" --set strategy.inner_steps=5
    many pier configs/pier-tiny.yaml "$world" --set strategy.inner_steps=5
    many gasloc configs/gasloc-tiny.yaml "$world" --set strategy.inner_steps=5
    # its overlapped exchange (overlap_steps > 0) is refused on CUDA for now: fragments only
    many streaming-diloco configs/streaming-diloco-tiny.yaml "$world" \
        --set strategy.inner_steps=10 --set strategy.overlap_steps=0
    many 1f1b configs/pipeline-1f1b-tiny.yaml "$pipe"
    many 2bw configs/2bw-tiny.yaml "$pipe"
    many ddp-fsdp configs/ddp-tiny.yaml "$world" --set parallel.shard=fsdp
    if python3 -c 'import deepspeed' >/dev/null 2>&1; then
        many deepspeed-zero1 configs/ddp-tiny.yaml "$world" --set strategy.backend=deepspeed \
            --set strategy.zero_stage=1
    else
        order+=("$runs/ranks/deepspeed-zero1")
        echo "deepspeed is not importable here" > "$runs/ranks/deepspeed-zero1.skipped"
    fi
    echo "== runs across $world ranks"
    python3 tools/gpu/ranks.py "${order[@]}"
fi  # the ranks part
tar -C "$runs" --exclude="*.pt" -czf "$out/runs.tgz" . 2>/dev/null
