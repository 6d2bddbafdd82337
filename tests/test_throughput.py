"""benchmark.throughput, the one A/B runner (throughput, start-up, the weight check), on tiny budgets: real runs of
2 iterations, no timing asserts; and the numpy rollout that makes the MLP scripts fast."""

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

from benchmark import common, throughput
from ddrl import rollout
from tests.helpers import ROOT

# Stands in for CleanRL's ppo_continuous_action.py (whose code the repository does not hold): its flags, its run
# folder, its charts/SPS per iteration, and its gymnasium 0.29 call that benchmark/cleanrl_compat.py must adapt.
CLEANRL_STAND_IN = """
import argparse, os, time
import gymnasium as gym, numpy as np, torch
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser()
for flag, default in [("--env-id", "HalfCheetah-v4"), ("--exp-name", "ppo_continuous_action"), ("--seed", 1),
                      ("--total-timesteps", 1000000), ("--num-envs", 1), ("--num-steps", 2048)]:
    parser.add_argument(flag, type=type(default), default=default)
args = parser.parse_args()
print(f"torch threads {torch.get_num_threads()}, cores {sorted(os.sched_getaffinity(0))}", flush=True)
env = gym.wrappers.TransformObservation(gym.make(args.env_id), lambda obs: np.clip(obs, -10, 10))
writer = SummaryWriter(f"runs/{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}")
env.reset(seed=args.seed)
global_step, start = 0, time.time()
for iteration in range(args.total_timesteps // (args.num_envs * args.num_steps)):
    for _ in range(args.num_envs * args.num_steps):
        global_step += 1
        if any(env.step(env.action_space.sample())[2:4]):
            env.reset()
    writer.add_scalar("charts/SPS", int(global_step / (time.time() - start)), global_step)
writer.close()
"""


def as_number(cell: str) -> float:
    """A table cell's number: `1,234` SPS, `35%` or `1.05` ratios, `1.2x` targets, `27,077 (env only)` bounds."""
    number = cell.split(" ")[0].replace(",", "").rstrip("x%")
    return float(number) / (100 if cell.split(" ")[0].endswith("%") else 1)


def assert_ratio(cell: str, numerator: str, denominator: str) -> None:
    """`cell` is numerator / denominator as the unrounded figures give it: the table shows whole SPS, which moves a
    ratio of small figures (a loaded machine's) by more than its own last digit."""
    top = as_number(numerator)
    bottom = as_number(denominator)
    digits = 0.0101 if cell.endswith("%") else 0.0051 if "." in cell else 0.5
    assert as_number(cell) == pytest.approx(top / bottom, abs=digits + top / bottom * (0.5 / top + 0.5 / bottom)), cell


def test_ours_and_cleanrl_alternate_on_one_core_beside_a_busy_one(tmp_path):
    """One round of ppo_continuous_mpi.py and of CleanRL's file (found in a checkout), on the first core with one
    thread beside a process busy on the last: every row's SPS and time split from its own events beside the bound, the
    CleanRL table from those rows, each run's start-up from its output, the weight check beside our iteration."""
    checkout = tmp_path / "cleanrl"
    (checkout / "cleanrl").mkdir(parents=True)
    (checkout / "cleanrl" / "ppo_continuous_action.py").write_text(CLEANRL_STAND_IN)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "stand-in"]):
        subprocess.run([*git, *command], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    work = tmp_path / "work"
    argv = ["--scripts", "ppo_continuous_mpi.py", "--cleanrl", str(checkout), "--variants"]
    argv += ["--loads", "busy core", "--cores", "one", "--iterations", "2", "--local-steps", "64", "--max-load", "-1"]
    text = throughput.main([*argv, "--env-seconds", "0.05", "--out", str(tmp_path / "vs"), "--out-dir", str(work)])
    text = text.read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")  # above the load limit: said at the top
    assert f"cleanrl/ppo_continuous_action.py (CleanRL {commit}), each run as `python benchmark/cleanrl_compat" in text
    rows = common.table_rows(text, "script")
    place = ", one core, one thread, beside a busy core"
    ours = f"{common.code_version(short=True)} (this checkout){place}"
    assert [row[1] for row in rows] == [ours, f"CleanRL {commit} ppo_continuous_action.py{place}"]
    assert rows[0][3] == rows[1][3] and rows[0][3].endswith("(env only)")  # one bound per setting
    assert rows[1][6:8] == ["", ""]  # CleanRL's file: no time split logged
    core = common.usable_cores()[0]
    for row, tag in zip(rows, ["this", "cleanrl"], strict=True):
        [run_dir] = (work / "runs").glob(f"*throughput__ppo_continuous_mpi__{tag}__busy__one_core__0*")
        events = common.read_scalar_events(run_dir)
        (wall_1, step_1, _), (wall_2, step_2, _) = events["charts/SPS"]
        assert step_2 - step_1 == 64  # --local-steps for both, under each one's flag names
        assert row[4] == f"{64 / (wall_2 - wall_1):,.0f}"
        assert_ratio(row[5], row[4], row[3])
        assert float(row[8]) >= 0.5  # the cores other processes kept busy: the busy core's process, at least
        if tag == "this":  # the time split of iteration 2, as the script timed it
            assert row[6:8] == [f"{events[f'perf/{part}_time'][1][2]:.3f}" for part in ("rollout", "update")]
        log = (work / "logs" / f"throughput__ppo_continuous_mpi__{tag}__busy__one_core__0.log").read_text()
        assert log.splitlines()[0].startswith(f"$ (cd {work} && taskset -c {core} env OMP_NUM_THREADS=1 ")
    assert f"torch threads 1, cores [{core}]" in log  # CleanRL's file too ran on the one core, one thread
    beyond = max(float(row[8]) for row in rows) - 1  # a run shared with other processes, the busy one aside
    if abs(beyond - throughput.MAX_OTHERS) > 0.005:  # said at the top
        assert ("SHARED CPU: other processes kept up to" in text.splitlines()[2]) == (beyond > throughput.MAX_OTHERS)
    [vs] = common.table_rows(text.split("## Beside CleanRL")[1], "script")
    assert vs[:7] == [
        "ppo_continuous_mpi.py",
        "ppo_continuous_action.py",
        "HalfCheetah-v5",
        place[2:],
        "as run",
        rows[1][4],
        rows[0][4],
    ]
    assert_ratio(vs[7], vs[6], vs[5])
    low, high = vs[9].split(" - ")  # one round: its ratio is the median, and the range's both ends
    assert vs[8] == vs[7] and low == high and float(low) == pytest.approx(float(vs[7]), abs=0.006)
    [startup] = common.table_rows(text, "script | run")  # CleanRL's file prints neither a batch table nor our lines
    batch_table, first_line, end = (float(startup[column]) for column in (2, 3, 5))
    assert startup[1] == ours and 0 < batch_table < first_line < end
    assert startup[4] == f"{first_line:.2f} - {first_line:.2f}"
    [check] = common.table_rows(text, "script | parameters")
    parameters = sum(p.numel() for p in common.agent_of("ppo_continuous_mpi.py").parameters())  # its default env's
    assert check[:2] == ["ppo_continuous_mpi.py", f"{parameters:,}"] and float(check[2]) > 0
    iteration = float(rows[0][6]) + float(rows[0][7])  # our rollout + update
    assert float(check[3]) == pytest.approx(iteration, abs=0.0011)
    assert as_number(check[4]) == pytest.approx(float(check[2]) / 1e3 / float(check[3]), rel=0.05, abs=2e-5)
    assert as_number(check[5]) == pytest.approx(as_number(check[4]) / throughput.CHECK_EVERY, rel=0.05, abs=2e-5)


def test_the_ab_tables_set_this_checkout_beside_the_other_round_by_round():
    """Two rounds of both checkouts: SPS and start-up as medians, this over the other's per round (median, range)."""
    other, this = (
        throughput.Contender(label, tag, ("python", "vpg_mpi.py")) for label, tag in [("b0", "other"), ("HEAD", "this")]
    )
    runs = {
        ("vpg_mpi.py", other, "quiet", "all"): [
            throughput.Result(100.0, 0.5, 0.5, 0.0, 1.0, 3.0, 4.0),
            throughput.Result(120.0, 0.5, 0.5, 0.0, 1.0, 5.0, 6.0),
        ],
        ("vpg_mpi.py", this, "quiet", "all"): [
            throughput.Result(110.0, 0.5, 0.5, 0.0, 1.0, 3.5, 4.5),
            throughput.Result(150.0, 0.5, 0.5, 0.0, 1.0, 4.5, 5.5),
        ],
    }
    [row] = throughput.beside_rows(runs, "checkout")
    assert row[:3] == ["vpg_mpi.py", common.defaults("vpg_mpi.py").env_id, "all usable cores (the defaults)"]
    assert row[3:] == ["as run", "110", "130", "1.182", "1.175", "1.10 - 1.25"]
    assert throughput.startup_rows(runs) == [
        ["vpg_mpi.py", "b0", "1.00", "4.00", "3.00 - 5.00", "5.00"],
        ["vpg_mpi.py", "HEAD", "1.00", "4.00", "3.50 - 4.50", "5.00"],
        ["vpg_mpi.py", "difference (this - other)", "", "+0.00", "", ""],
    ]


def test_the_atari_bound_is_its_compute_limit_from_its_parts():
    """8 envs' samples over one act per env step plus 16 minibatch steps per 128 env steps (its defaults)."""
    assert sum(p.numel() for p in common.agent_of(common.ATARI).parameters()) == 1_686_693  # the Nature CNN
    limit, (act_ms, step_ms) = throughput.bound(common.ATARI, 0.01)
    assert act_ms > 0 and step_ms > 0 and limit == pytest.approx(8 / (act_ms + 16 * step_ms / 128) * 1e3)
    bounds = {(common.ATARI, "quiet", "all"): [limit]}
    contender = throughput.Contender("HEAD", "this", ("python", common.ATARI))
    result = throughput.Result(limit * 1.3, 0.5, 0.25, 0.0, 1.0, 2.0, 3.0)
    [row] = throughput.throughput_rows({(common.ATARI, contender, "quiet", "all"): [result]}, bounds)
    assert row[3] == f"{limit:,.0f} (compute limit)" and row[5] == "1.30"  # a factor, not a share


def test_the_two_checkouts_swap_places_every_round_and_the_other_rows_follow_them():
    args = throughput.Args(
        scripts=("vpg_mpi.py",), variants=("vpg_mpi.py --check-sync-every 1", "ppo_atari_multigpu.py --bf16")
    )
    labels = {"other": "b0d01c8", "this": "HEAD (this checkout)"}
    other, this, variant = throughput.contenders(args, "vpg_mpi.py", {"other": ROOT.parent, "this": ROOT}, labels, {})
    assert variant == throughput.Contender(
        "HEAD (this checkout) --check-sync-every 1", "check-sync-every_1",
        (str(ROOT / "vpg_mpi.py"), "--check-sync-every", "1"), "variant",
    )  # fmt: skip
    assert other.command == (str(ROOT.parent / "vpg_mpi.py"),) and this.tag == "this"
    assert throughput.in_turn([other, this, variant], 0) == [other, this, variant]
    assert throughput.in_turn([other, this, variant], 1) == [this, other, variant]
    assert throughput.in_turn([this, variant], 1) == [this, variant]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--iterations must be at least 2, got 1"):
        throughput.main(["--iterations", "1", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="each of --variants starts with one of"):
        throughput.main(["--variants", "ppo_atari.py --bf16", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--ranks above 1 runs without --cores one"):
        throughput.main(["--ranks", "2", "--cores", "one", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="holds no CleanRL ppo_continuous_action.py or ppo_atari.py"):
        throughput.main(["--cleanrl", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="has no vpg_mpi.py"):
        throughput.main(["--scripts", "vpg_mpi.py", "--compare-with", str(tmp_path), "--out", str(tmp_path / "x")])
    compat = [sys.executable, str(ROOT / "benchmark" / "cleanrl_compat.py"), str(tmp_path / "ppo_atari.py")]
    refused = subprocess.run(compat, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("cleanrl_compat.py: error: give an existing CleanRL")
    assert refused.stderr.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize(
    ("script", "env_id"), [("vpg_mpi.py", "CartPole-v1"), ("ppo_continuous_mpi.py", "HalfCheetah-v5")]
)
def test_numpy_rollout_acts_as_the_agent_and_follows_updates_and_loads(script, env_id):
    """The rollout's numpy programs (over views of the parameters and the statistics buffers) against the Agent's own
    get_action_and_value and get_value, after an optimizer step, new statistics and a load_state_dict made with the
    programs built: seeded by numpy's stream, a deterministic mode, a Categorical's draws following its softmax."""
    module = common.load_script(script)
    envs = gym.vector.SyncVectorEnv([module.make_env(module.Args(env_id=env_id))])
    torch.manual_seed(0)
    agent, other = (module.Agent(envs) for _ in range(2))
    acting = rollout.derive(agent, envs.single_observation_space)
    mode = rollout.derive(agent, envs.single_observation_space, deterministic=True)
    assert acting.kind == "numpy versions of the Agent's methods"
    obs = torch.randn(5, envs.single_observation_space.shape[0])
    for change in ("none", "step", "load"):
        if change == "step":  # and, for PPO, the observations' statistics that normalise the Agent's input
            optimizer = torch.optim.Adam(agent.parameters(), lr=0.1)
            sum(p.sum() for p in agent.parameters()).backward()
            optimizer.step()
            if hasattr(agent, "obs_rms"):
                agent.obs_rms.update(torch.tensor(7.0), obs.double().mean(0), obs.double().var(0) * 7)
        elif change == "load":
            agent.load_state_dict(other.state_dict())
        np.random.seed(1)
        actions, log_prob, _, value = acting.get_action_and_value(obs.numpy())
        np.random.seed(1)
        assert np.array_equal(acting.get_action_and_value(obs.numpy())[0], actions), change  # from numpy's seed
        with torch.no_grad():  # the rollout's numbers are the update's: PPO's ratio starts at 1
            _, expected_log_prob, _, expected_value = agent.get_action_and_value(obs, torch.as_tensor(actions))
            np.testing.assert_allclose(
                acting.get_value(obs.numpy()), agent.get_value(obs).numpy(), rtol=1e-5, atol=1e-5
            )
        np.testing.assert_allclose(value, expected_value.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
        np.testing.assert_allclose(log_prob, expected_log_prob.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
        greedy = mode.get_action_and_value(obs.numpy())[0]
        with torch.no_grad():
            actor = agent.actor if script == "vpg_mpi.py" else agent.actor_mean
            scores = actor(obs if script == "vpg_mpi.py" else agent.obs_rms.normalize(obs))
        expected_mode = scores.argmax(-1) if env_id == "CartPole-v1" else scores
        np.testing.assert_allclose(greedy, expected_mode.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
    if env_id == "CartPole-v1":  # sampled actions follow the softmax (made far from uniform first)
        with torch.no_grad():  # logits 0 and log 3 at every observation: probabilities 1/4 and 3/4, whatever the init
            agent.actor[-1].weight.zero_()
            agent.actor[-1].bias.copy_(torch.tensor([0.0, np.log(3.0)]))
        np.random.seed(2)
        draws = acting.get_action_and_value(np.repeat(obs[:1].numpy(), 20_000, axis=0))[0]
        np.testing.assert_allclose(np.bincount(draws, minlength=2) / len(draws), [0.25, 0.75], atol=0.015)
    envs.close()
