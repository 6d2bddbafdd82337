"""Edits a researcher makes beside the Agent, written as they would write them: a second module with its own
optimizer (CleanRL's RND), a KL penalty's coefficient adapted as the run goes, two optimizers, statistics a rank keeps
under DDP. `python -m ddrl.verify` and the sync check a run makes every iteration find every module, optimizer and
number the copy trains with, over the whole run: each says so of the broken edits, naming the object, and passes the
correct ones."""

import re
from pathlib import Path

from tests.helpers import ROOT, edited_copy, progress_lines, run_command, torchrun_with, verified, verify

CONTINUOUS_FLAGS = ["--env-id", "InvertedPendulum-v5", "--num-steps", "64", "--total-timesteps", "512", "--no-compile"]
CONTINUOUS_FLAGS += ["--num-minibatches", "4", "--update-epochs", "2", "--torch-threads", "1"]
ATARI_FLAGS = ["--local-num-envs", "2", "--num-steps", "16", "--total-timesteps", "256", "--num-minibatches", "2"]
ATARI_FLAGS += ["--update-epochs", "1", "--torch-threads", "1", "--no-cuda"]

RND_MODULE = '''

class RNDModel(nn.Module):
    """CleanRL's random network distillation: a fixed random target, a predictor trained to match it."""

    def __init__(self, obs_dim: int):
        super().__init__()
        self.target = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.ReLU(), layer_init(nn.Linear(64, 16)))
        self.predictor = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.ReLU(), layer_init(nn.Linear(64, 16)))
        for parameter in self.target.parameters():
            parameter.requires_grad = False


# --- GAE ---'''
# CleanRL's ppo_rnd_envpool.py beside continuous PPO: a second module with an optimizer of its own, its predictor
# trained after the update on each rank's batch, its gradients never averaged
RND_OWN_OPTIMIZER = [
    ("\n\n# --- GAE ---", RND_MODULE),
    (
        "        collectives.broadcast_parameters(agent)\n",
        "        collectives.broadcast_parameters(agent)\n"
        "        rnd_model = RNDModel(obs_dim).to(device)\n"
        "        rnd_optimizer = optim.Adam(rnd_model.predictor.parameters(), lr=1e-3)\n",
    ),
    (
        "            update_time = time.perf_counter() - update_start\n",
        "            update_time = time.perf_counter() - update_start\n"
        '            rnd_obs = agent.obs_rms.normalize(batch["obs"])\n'
        "            rnd_loss = ((rnd_model.predictor(rnd_obs) - rnd_model.target(rnd_obs)) ** 2).mean()\n"
        "            rnd_optimizer.zero_grad()\n"
        "            rnd_loss.backward()\n"
        "            rnd_optimizer.step()\n",
    ),
]
# a KL penalty whose coefficient, a buffer of the Agent, adapts to the KL after each update
KL_PENALTY = [
    (
        "        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))\n",
        "        self.actor_logstd = nn.Parameter(torch.zeros(1, action_dim))\n"
        '        self.register_buffer("kl_beta", torch.tensor(1.0))\n',
    ),
    (
        "    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef\n",
        "    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef\n"
        "    loss = loss + agent.kl_beta * ((ratio - 1) - logratio).mean()\n",
    ),
]
KL_FROM = [  # measured after the update, taken at the next iteration's start: a number main carries
    (
        "        while global_step < run.total_steps:",
        "        last_kl = 0.01\n        while global_step < run.total_steps:",
    ),
    (
        "            iteration += 1\n",
        "            iteration += 1\n"
        "            agent.kl_beta.copy_(torch.clamp(agent.kl_beta * (1 + 10 * (last_kl - 0.01)), 0.1, 10.0))\n",
    ),
    (
        "            update_time = time.perf_counter() - update_start\n",
        "            update_time = time.perf_counter() - update_start\n"
        "            with torch.no_grad():\n"
        '                _, new_log_prob, _, _ = agent.get_action_and_value(batch["obs"], batch["actions"])\n'
        '                kl = (batch["log_probs"] - new_log_prob).mean().reshape(1)\n'
        "{world}"
        "            last_kl = float(kl[0])\n",
    ),
]
LOCAL_KL = [*KL_PENALTY, *KL_FROM[:2], (KL_FROM[2][0], KL_FROM[2][1].format(world=""))]  # each rank's own KL
WORLD_KL = [
    *KL_PENALTY,
    *KL_FROM[:2],
    (KL_FROM[2][0], KL_FROM[2][1].format(world="            kl = collectives.allreduce_mean(kl)\n")),
]
# SpinningUp's own two Adams, one for the policy at --pi-lr, one for the value function at --vf-lr
TWO_OPTIMIZERS = [
    (
        "    agent: Agent,\n    optimizer: optim.Optimizer,\n    batch: Batch,",
        "    agent: Agent,\n    pi_optimizer: optim.Optimizer,\n    vf_optimizer: optim.Optimizer,\n    batch: Batch,",
    ),
    (
        '    stepped = [p for group in optimizer.param_groups for p in group["params"]]',
        '    stepped = [p for o in (pi_optimizer, vf_optimizer) for group in o.param_groups for p in group["params"]]',
    ),
    (
        "    optimizer.zero_grad()\n    policy_loss.backward()",
        "    pi_optimizer.zero_grad()\n    vf_optimizer.zero_grad()\n    policy_loss.backward()",
    ),
    ("    optimizer.step()  # the value function's", "    pi_optimizer.step()  # the value function's"),
    (
        "        optimizer.zero_grad()\n        value_loss.backward()",
        "        vf_optimizer.zero_grad()\n        value_loss.backward()",
    ),
    (
        "        sync_time += time.perf_counter() - start\n        optimizer.step()\n",
        "        sync_time += time.perf_counter() - start\n        vf_optimizer.step()\n",
    ),
    (
        "        optimizer = optim.Adam(\n"
        "            [\n"
        '                {"params": policy_parameters, "lr": args.pi_lr},\n'
        '                {"params": list(agent.critic.parameters()), "lr": args.vf_lr},\n'
        "            ]\n"
        "        )\n",
        "        pi_optimizer = optim.Adam(policy_parameters, lr=args.pi_lr)\n"
        "        vf_optimizer = optim.Adam(agent.critic.parameters(), lr=args.vf_lr)\n",
    ),
    ("run.resume(agent=agent, optimizer=optimizer)", "run.resume(agent=agent, pi=pi_optimizer, vf=vf_optimizer)"),
    ("update(agent, optimizer, batch, args)", "update(agent, pi_optimizer, vf_optimizer, batch, args)"),
    ("update(agent, optimizer, union, args, group)", "update(agent, pi_optimizer, vf_optimizer, union, args, group)"),
    ('optimizer.param_groups[0]["lr"]}', 'pi_optimizer.param_groups[0]["lr"]}'),
    ("agent=agent, optimizer=optimizer)\n", "agent=agent, pi=pi_optimizer, vf=vf_optimizer)\n"),
]
# statistics each rank keeps as a buffer of the Agent, set from its own returns before the update, under DDP
ATARI_RANK_BUFFER = [
    (
        "        self.critic = layer_init(nn.Linear(512, 1), std=1)\n",
        "        self.critic = layer_init(nn.Linear(512, 1), std=1)\n"
        '        self.register_buffer("return_mean", torch.zeros(()))\n',
    ),
    (
        '            rollout.check(agent, batch, f"at iteration {iteration}", acting_kind, groups[0].stop)\n',
        '            rollout.check(agent, batch, f"at iteration {iteration}", acting_kind, groups[0].stop)\n'
        '            agent.return_mean.copy_(batch["returns"].mean())\n',
    ),
]


def failed_line(result) -> str:
    assert result.returncode == 1 and result.stdout == "", (result.returncode, result.stdout, result.stderr)
    [line] = result.stderr.strip().splitlines()
    return line


# a Polyak-averaged target critic, made as researchers make it (copy.deepcopy, which registers no tensor), its
# averaging step taken by rank 0 alone
TARGET_ON_RANK_0 = [
    ("\nimport math\n", "\nimport copy\nimport math\n"),
    (
        "        collectives.broadcast_parameters(agent)\n",
        "        collectives.broadcast_parameters(agent)\n        target_critic = copy.deepcopy(agent.critic)\n",
    ),
    (
        "            update_time = time.perf_counter() - update_start\n",
        "            update_time = time.perf_counter() - update_start\n"
        "            with torch.no_grad():\n"
        "                for target, trained in zip(target_critic.parameters(), agent.critic.parameters()):\n"
        "                    target.lerp_(trained, 0.05 if run.rank == 0 else 0.0)\n",
    ),
]


def stopped_line(result, script: str) -> str:
    """The one error line of a run the sync check stopped, from any rank."""
    assert result.returncode != 0, result.stdout
    [line] = sorted({line for line in result.stderr.splitlines() if line.startswith(f"{script}: error: ")})
    return line


def test_a_second_module_whose_gradients_are_not_averaged_fails_verify_naming_it(tmp_path):
    line = failed_line(verify(edited_copy(tmp_path, "ppo_continuous_mpi.py", RND_OWN_OPTIMIZER)))
    assert line.startswith("verify: at two ranks (allreduce), iteration 1: rank 0's rnd_model.predictor."), line
    assert "their gradients differed between the ranks, so they were not averaged" in line


def test_a_second_module_whose_gradients_are_not_averaged_stops_a_two_rank_run_at_the_first_iteration(tmp_path):
    copy = edited_copy(tmp_path, "ppo_continuous_mpi.py", RND_OWN_OPTIMIZER)
    result = run_command(torchrun_with(["--standalone"], str(copy), CONTINUOUS_FLAGS), tmp_path)
    line = stopped_line(result, "ppo_continuous_mpi.py")
    assert "differs from this rank's at iteration 1 (rnd_model.predictor." in line, line
    assert "the gradients of rnd_model.predictor." in line and "so they were not averaged" in line, line
    assert progress_lines(result.stdout) == [1]
    assert "python -m ddrl.verify" not in line  # it names the cause, no tool to run


def test_a_deep_copied_target_network_each_rank_moves_alone_stops_a_run_and_fails_verify_naming_it(tmp_path):
    """copy.deepcopy registers no tensor: the modules main holds are found as they stand, the copy too."""
    copy = edited_copy(tmp_path, "ppo_continuous_mpi.py", TARGET_ON_RANK_0)
    result = run_command(torchrun_with(["--standalone"], str(copy), CONTINUOUS_FLAGS), tmp_path)
    line = stopped_line(result, "ppo_continuous_mpi.py")
    assert "differs from this rank's at iteration 1 (target_critic.0.weight" in line, line
    line = failed_line(verify(copy))
    assert re.match(r"verify: at two ranks \(allreduce\), iteration 1: rank 1's target_critic\.0\.weight", line), line


def test_a_kl_coefficient_each_rank_adapts_from_its_own_kl_fails_verify(tmp_path):
    line = failed_line(verify(edited_copy(tmp_path, "ppo_continuous_mpi.py", LOCAL_KL)))
    assert re.match(r"verify: at two ranks \(allreduce\), iteration 1: rank [01]'s last_kl is ", line), line
    assert "where the one-rank run's is" in line and "computed from that rank's data alone" in line


def test_a_kl_coefficient_each_rank_adapts_from_its_own_kl_stops_a_default_two_rank_run_by_the_second_iteration(
    tmp_path,
):
    copy = edited_copy(tmp_path, "ppo_continuous_mpi.py", LOCAL_KL)
    result = run_command(torchrun_with(["--standalone"], str(copy), CONTINUOUS_FLAGS), tmp_path)
    line = stopped_line(result, "ppo_continuous_mpi.py")
    assert re.search(r"differs from this rank's at iteration [12] \((last_kl|agent.kl_beta)", line), line
    assert len(progress_lines(result.stdout)) <= 2


def test_the_kl_coefficient_adapted_from_the_worlds_kl_passes_verify(tmp_path):
    said = verified(edited_copy(tmp_path, "ppo_continuous_mpi.py", WORLD_KL))
    assert "(allreduce, gather) trains as one rank on the union of their batches for 3 iterations" in said


def test_two_optimizers_with_their_own_learning_rates_pass_verify_in_both_sync_modes(tmp_path):
    said = verified(edited_copy(tmp_path, "vpg_mpi.py", TWO_OPTIMIZERS))
    assert said.startswith("verify: ok: vpg_mpi.py at two ranks (allreduce, gather) "), said


def test_statistics_a_rank_keeps_under_ddp_are_not_replaced_by_rank_0s_but_stop_the_run(tmp_path):
    """DDP's default broadcast of buffers would give every rank rank 0's statistics at each forward, so that the
    ranks agreed by the check while training on rank 0's numbers alone; the buffers stay each rank's own."""
    copy = edited_copy(tmp_path, "ppo_atari_multigpu.py", ATARI_RANK_BUFFER)
    result = run_command(torchrun_with(["--standalone"], str(copy), ATARI_FLAGS), tmp_path)
    line = stopped_line(result, "ppo_atari_multigpu.py")
    assert "differs from this rank's at iteration 1 (agent.return_mean)" in line, line


def test_verify_ends_what_a_copy_forks_at_import_and_writes_nothing_where_it_changes_folder(tmp_path):
    """At every import (verify's probe and each rank's) the copy forks a child that would sleep for ten minutes, then
    changes its folder: once verify has said its line, no child is left and the other folder holds nothing."""
    elsewhere = tmp_path / "elsewhere"
    children = tmp_path / "children"
    elsewhere.mkdir()
    children.mkdir()
    forks = (
        "import os as _os\nimport time as _time\n\n"
        "if _os.fork() == 0:\n"
        f"    open(f'{children}/{{_os.getpid()}}', 'w').close()\n"
        "    _os.setsid()  # out of verify's process group\n"
        "    _time.sleep(600)\n"
        "    _os._exit(0)\n"
        f"_os.chdir({str(elsewhere)!r})\n"
    )
    source = (ROOT / "vpg_mpi.py").read_text().replace("\nimport ddrl\n", "\nimport ddrl\n" + forks, 1)
    copy = tmp_path / "vpg_mpi.py"
    copy.write_text(source)
    verified(copy)
    pids = [int(path.name) for path in children.iterdir()]
    assert len(pids) >= 4  # the probe's import and each rank's
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert list(elsewhere.iterdir()) == []
