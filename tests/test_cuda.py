"""The CUDA paths on a real GPU: every script trains on cuda:LOCAL_RANK, over `cpu:gloo,cuda:nccl` with a GPU per
rank and over gloo (with a warning) when ranks share one, and every rank ends with the same weights on its GPU.
Skipped where torch sees no GPU (CI has none); run them on a GPU machine with `python -m pytest tests/test_cuda.py`."""

import numpy as np
import pytest
import torch

from tests.helpers import (
    assert_ok,
    assert_same_parameters,
    compiled_files,
    rank_parameters,
    read_scalars,
    run_dirs,
    torchrun,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# per script: its flags for two short iterations on the GPU (the Atari script takes the GPU by default)
GPU_RUNS = {
    "ppo_atari_multigpu.py": ["--local-num-envs", "2", "--num-steps", "128", "--num-minibatches", "2"],
    "ppo_continuous_mpi.py": ["--cuda", "--env-id", "Hopper-v5", "--num-steps", "256", "--num-minibatches", "4"],
    "vpg_mpi.py": ["--cuda", "--env-id", "CartPole-v1", "--steps-per-epoch", "1000", "--train-v-iters", "5"],
}
# per script: global env steps per iteration at `ranks` ranks with the flags above
STEPS_PER_ITERATION = {"ppo_atari_multigpu.py": 256, "ppo_continuous_mpi.py": 256, "vpg_mpi.py": 1000}


def train_on_gpu(script: str, ranks: int, flags: list[str], tmp_path, **env: str) -> tuple[str, str]:
    """Two iterations of `script` at `ranks` ranks on the GPU(s); checks they ran there in step; (stdout, stderr)."""
    local = STEPS_PER_ITERATION[script]
    world = local if script == "vpg_mpi.py" else local * ranks  # vpg splits its global epoch, PPO adds per-rank batches
    flags = [*GPU_RUNS[script], *flags, "--total-timesteps", str(2 * world)]
    result = torchrun(script, flags, tmp_path, nprocs=ranks, save_ranks=True, **env)
    assert_ok(result)
    states = rank_parameters(tmp_path, ranks)
    assert all(tensor.is_cuda for state in states for tensor in state.values())
    assert_same_parameters(states)
    [run_dir] = run_dirs(tmp_path)
    scalars = read_scalars(run_dir)
    assert [step for step, _ in scalars["charts/SPS"]] == [world, 2 * world]
    assert all(np.isfinite(value) for _, value in scalars["losses/value_loss"])
    return result.stdout, result.stderr


@pytest.mark.parametrize("script", list(GPU_RUNS))
def test_one_rank_trains_on_the_gpu_with_nccl_beside_gloo(script, tmp_path):
    stdout, _ = train_on_gpu(script, 1, [], tmp_path)
    assert "torch cpu:gloo,cuda:nccl" in stdout  # the batch table's collectives row


@pytest.mark.parametrize("script", list(GPU_RUNS))
def test_two_ranks_train_identically_on_the_gpus(script, tmp_path):
    flags = ["--sync", "gather"] if script != "ppo_atari_multigpu.py" else []
    stdout, stderr = train_on_gpu(script, 2, flags, tmp_path)
    if torch.cuda.device_count() >= 2:
        assert "torch cpu:gloo,cuda:nccl" in stdout
    else:  # both ranks on one GPU: NCCL refuses two ranks per device, so gloo carries everything, and says so
        assert "torch gloo" in stdout and "ranks share 1 GPU(s)" in stderr


def test_atari_bf16_and_compile_train_on_the_gpu(tmp_path):
    compiled_before = compiled_files()
    _, stderr = train_on_gpu("ppo_atari_multigpu.py", 1, ["--bf16", "--compile"], tmp_path)
    assert compiled_files() - compiled_before  # it compiled new kernels
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert "emulates bfloat16" not in stderr
