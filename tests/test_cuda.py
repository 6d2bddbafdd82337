"""The CUDA paths on a real GPU: every script trains on cuda:LOCAL_RANK, over `cpu:gloo,cuda:nccl` with a GPU per
rank and over gloo (with a warning) when ranks share one, and every rank ends with the same weights on its GPU; the
Atari script's acting step as a CUDA graph and its fused Adam. Skipped where torch sees no GPU (CI has none); run them
on a GPU machine with `python -m pytest tests/test_cuda.py`."""

from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_atari_multigpu as ppo
from ddrl import atari, cuda_graphs, rollout
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
FOUR_ACTIONS = SimpleNamespace(single_action_space=gym.spaces.Discrete(4))  # what Agent reads of Breakout's envs
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


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_atari_rollout_acts_as_the_agent_on_the_gpu_with_fresh_draws_every_step(graph):
    """The acting step, in two groups of envs, on the same frames every step: the host gets the actions its rows hold,
    the rows hold what Agent.get_action_and_value computes for them, every replay draws anew from the policy's
    probabilities, and the same CUDA seed draws the same actions."""
    device = torch.device("cuda")
    steps = 40
    envs = 64
    torch.manual_seed(1)
    agent = ppo.Agent(FOUR_ACTIONS).to(device, memory_format=torch.channels_last)
    frames = torch.randint(0, 256, (envs, 4, 84, 84), dtype=torch.uint8)
    draws = []
    for _ in range(2):
        torch.cuda.manual_seed(7)
        storage = {
            "obs": torch.zeros((steps, envs, 4, 84, 84), dtype=torch.uint8, device=device),
            "actions": torch.zeros((steps, envs), dtype=torch.long, device=device),
            "log_probs": torch.zeros((steps, envs), device=device),
            "values": torch.zeros((steps, envs), device=device),
        }
        groups = atari.env_groups(envs, 2)  # as a GPU run steps them: in turn
        act = cuda_graphs.acting_step(agent, *storage.values(), groups, graph=graph)
        assert act.__name__ == ("act_by_graph_replay" if graph else "act_eagerly")
        sent = [np.concatenate([act(step, frames[group].numpy(), group) for group in groups]) for step in range(steps)]
        draws.append(np.stack(sent))
        assert np.array_equal(draws[-1], storage["actions"].cpu().numpy())
        assert bool((storage["obs"].cpu() == frames).all())
        batch = {key: value.flatten(0, 1) for key, value in storage.items()}
        rollout.check(agent, batch, "in the test", "the acting step", len(batch["obs"]))  # exits unless they agree
    assert np.array_equal(draws[0], draws[1])  # seeded
    assert (draws[0] != draws[0][0]).any(0).all()  # every env's action varies: no replay repeats a frozen draw
    with torch.no_grad():
        logits = agent.actor(agent.network(frames.to(device) / 255.0))
        probs = torch.softmax(logits, -1).mean(0).cpu().numpy()
    frequencies = np.bincount(draws[0].ravel(), minlength=4) / draws[0].size
    assert np.abs(frequencies - probs).max() < 0.035  # 2,560 draws: about 4 standard deviations


def test_atari_update_on_the_gpu_applies_no_step_once_a_gradient_is_not_finite():
    """Fused Adam reads the non-finite flag on the GPU: the first minibatch's step stands, the second (a NaN return)
    and every later one are not applied, and the update then stops the run."""
    device = torch.device("cuda")
    torch.manual_seed(1)
    agent = ppo.Agent(FOUR_ACTIONS).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5, fused=True)
    obs = torch.randint(0, 256, (64, 4, 84, 84), dtype=torch.uint8, device=device)
    actions = torch.randint(0, 4, (64,), device=device)
    with torch.no_grad():
        _, log_probs, _, values = agent.get_action_and_value(obs, actions)
    returns = torch.randn(64, device=device)
    returns[40] = float("nan")  # in the second minibatch of the first epoch
    batch = {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values.view(-1)}
    batch.update(advantages=torch.randn(64, device=device), returns=returns)
    before = [p.detach().clone() for p in agent.parameters()]
    args = ppo.Args(num_minibatches=2, update_epochs=2)
    orders = torch.arange(64, device=device).repeat(2, 1)
    with pytest.raises(ppo.NonFiniteError):
        ppo.update(ppo.ActionAndValue(agent), optimizer, batch, args, orders, ppo.minibatch_sizes([64], 2))
    assert all(optimizer.state[p]["step"].item() == 1 for p in agent.parameters())  # one step of four applied
    assert all(p.isfinite().all() for p in agent.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(agent.parameters(), before, strict=True))


def test_atari_update_on_the_gpu_is_one_compiled_region_that_takes_the_eager_steps():
    """--capture-update: the minibatch step's forward, loss and backward as a compiled region replayed as CUDA graphs
    (main's torch.compile of minibatch_loss), over several minibatches and epochs, ends where the eager update ends,
    to float32 rounding, with the same losses (clipfrac too, which the update keeps across replays)."""
    device = torch.device("cuda")
    args = ppo.Args(num_minibatches=4, update_epochs=3, capture_update=True)
    torch.manual_seed(2)
    obs = torch.randint(0, 256, (256, 4, 84, 84), dtype=torch.uint8, device=device)
    actions = torch.randint(0, 4, (256,), device=device)
    log_probs = -1.4 + 0.2 * torch.randn(256, device=device)  # about the initial policy's: some ratios clip
    batch = {"obs": obs, "actions": actions, "log_probs": log_probs}
    batch |= {"values": torch.randn(256, device=device), "advantages": torch.randn(256, device=device)}
    batch["returns"] = torch.randn(256, device=device)
    orders = torch.stack([torch.randperm(256, device=device) for _ in range(args.update_epochs)])
    sizes = ppo.minibatch_sizes([256], args.num_minibatches)
    captured_loss = torch.compile(ppo.minibatch_loss, mode="reduce-overhead", dynamic=False)  # as main compiles it
    ends = []
    for loss_fn in (ppo.minibatch_loss, captured_loss):
        torch.manual_seed(1)
        agent = ppo.Agent(FOUR_ACTIONS).to(device, memory_format=torch.channels_last)
        optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5, fused=True)
        losses, _ = ppo.update(ppo.ActionAndValue(agent), optimizer, batch, args, orders, sizes, loss_fn=loss_fn)
        ends.append(({key: value.clone() for key, value in agent.state_dict().items()}, losses))
    (eager, eager_losses), (captured, captured_losses) = ends
    for key in eager:
        torch.testing.assert_close(captured[key], eager[key], rtol=1e-4, atol=1e-5, msg=key)
    torch.testing.assert_close(captured_losses, eager_losses, rtol=1e-3, atol=1e-5)
    assert 0 < eager_losses["clipfrac"] < 1  # some ratios clipped: a stale clipfrac would show


@pytest.mark.parametrize(
    "flags",
    [[], ["--env-groups", "2"], ["--capture-update"], ["--env-groups", "2", "--capture-update"]],
    ids=["default", "env-groups-2", "capture-update", "both"],
)
def test_atari_trains_on_the_gpu_by_default_and_with_each_new_path(flags, tmp_path):
    """The GPU default (acting as a CUDA graph per step, one group of envs, an eager update) and each path not yet the
    default, on its own and together: two iterations in step, finite losses, and the same run twice from one seed (the
    acting graph draws from the seeded CUDA generator, the update is deterministic)."""
    losses = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        train_on_gpu("ppo_atari_multigpu.py", 1, ["--seed", "3", *flags], tmp_path / name)
        scalars = read_scalars(run_dirs(tmp_path / name)[0])
        losses.append({key: series for key, series in scalars.items() if key.startswith("losses/")})
    assert losses[0] == losses[1] and len(losses[0]) == 7  # minibatch_loss's six and the explained variance


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
