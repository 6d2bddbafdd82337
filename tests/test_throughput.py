"""benchmark.throughput on tiny budgets (real runs of every script, 2 iterations of 64 steps), no timing asserts."""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmark import common, throughput
from tests.helpers import ROOT


def as_number(cell: str) -> float:
    """A table cell's number: `1,234` SPS, `35%` or `1.05` ratios, `1.2x` targets, `27,077 (env only)` bounds."""
    number = cell.split(" ")[0].replace(",", "").rstrip("x%")
    return float(number) / (100 if cell.split(" ")[0].endswith("%") else 1)


def assert_ratio(cell: str, numerator: str, denominator: str) -> None:
    """`cell` is numerator / denominator as the unrounded figures give it: the table shows whole SPS, which moves a
    ratio of small figures (a loaded machine's) by more than its own last digit."""
    top, bottom = as_number(numerator), as_number(denominator)
    digits = 0.0101 if cell.endswith("%") else 0.0051 if "." in cell else 0.5
    assert as_number(cell) == pytest.approx(top / bottom, abs=digits + top / bottom * (0.5 / top + 0.5 / bottom)), cell


def test_throughput_table_sets_every_script_beside_its_bound(tmp_path, capsys):
    """Every row: the SPS and the time split from the run's own TensorBoard events (iterations 2..), the ratio from
    the SPS and the bound, met from the ratio and the target; the Atari bound from the parts of its compute limit."""
    work = tmp_path / "work"
    argv = ["--iterations", "2", "--local-steps", "64", "--env-seconds", "0.1", "--out", str(tmp_path / "throughput")]
    argv += ["--out-dir", str(work), "--variants", "ppo_atari_multigpu.py --bf16"]  # --compile: a minute of compiling
    text = throughput.main([*argv, "--max-load", "1000"]).read_text()
    assert "MEASURED UNDER LOAD" not in text and "python -m benchmark.throughput --iterations 2" in text
    rows = common.table_rows(text, "script")
    # every script (its defaults but the batch), then the variant: Atari with --bf16, beside the same bound
    assert [row[0] for row in rows] == [*common.SCRIPTS, "ppo_atari_multigpu.py"]
    assert rows[-1][1].endswith("(this checkout) --bf16") and rows[-1][3] == rows[-2][3]
    assert common.table_rows(text, "script | CleanRL file") == []  # no --cleanrl, no comparison
    printed = capsys.readouterr().out
    runs = [f"throughput__{script[:-3]}__this__0" for script in common.SCRIPTS]
    runs.append("throughput__ppo_atari_multigpu__bf16__0")
    for script, row, run in zip([*common.SCRIPTS, "ppo_atari_multigpu.py"], rows, runs, strict=True):
        assert "(this checkout)" in row[1]
        assert row[3].endswith("(compute limit)" if script == "ppo_atari_multigpu.py" else "(env only)")
        assert f"{script}: " in printed
        events = common.read_scalar_events(work / "runs" / run)
        (wall_1, step_1, _), (wall_2, step_2, _) = events["charts/SPS"]
        assert step_2 - step_1 == 64  # --local-steps, whatever the script's own batch
        assert row[4] == f"{(step_2 - step_1) / (wall_2 - wall_1):,.0f}"
        assert row[8:10] == [f"{events[f'perf/{part}_time'][1][2]:.3f}" for part in ("rollout", "update")]
        assert float(row[10]) >= 0  # the cores other processes (the other test's) kept busy
        assert_ratio(row[5], row[4], row[3])
        assert row[5].endswith("%") != (script == "ppo_atari_multigpu.py")  # shares of the env rate, Atari a factor
        ratio, target = as_number(row[4]) / as_number(row[3]), throughput.TARGETS[script]
        assert as_number(row[6]) == pytest.approx(target)
        if abs(ratio / target - 1) > 0.5 / as_number(row[4]) + 0.5 / as_number(row[3]):  # not within the rounding
            assert row[7] == ("yes" if ratio >= target else "no")
    most = max(float(row[10]) for row in rows)  # a run shared with other processes: said at the top
    if abs(most - throughput.MAX_OTHERS) > 0.005:
        assert ("SHARED CPU: other processes kept up to" in text.splitlines()[2]) == (most > throughput.MAX_OTHERS)
    # the Atari bound: 8 envs' samples over one act per env step plus 16 minibatch steps per 128 env steps
    act_ms, step_ms = map(float, re.search(r"batch-8 act ([\d.]+) ms, minibatch-256 step ([\d.]+) ms", text).groups())
    limit, rounding = 8 / (act_ms + 16 * step_ms / 128) * 1e3, (0.005 + 16 * 0.05 / 128) / (act_ms + 16 * step_ms / 128)
    assert as_number(rows[2][3]) == pytest.approx(limit, rel=rounding + 0.5 / limit)


def test_compare_with_another_checkout_alternates_the_two_quiet_and_beside_a_busy_core(tmp_path):
    """Both checkouts, alternately, on the machine as it is and again beside a process spinning on the last usable
    core."""
    work = tmp_path / "work"
    argv = ["--scripts", "vpg_mpi.py", "--env-id", "CartPole-v1", "--iterations", "2", "--local-steps", "500"]
    argv += ["--env-seconds", "0.1"]
    argv += ["--compare-with", str(ROOT), "--loads", "quiet", "busy core"]
    argv += ["--out", str(tmp_path / "ab"), "--out-dir", str(work), "--max-load", "-1"]
    text = throughput.main(argv).read_text()
    assert text.splitlines()[2].startswith("**MEASURED UNDER LOAD")  # above the load limit: said at the top
    rows = common.table_rows(text, "script")
    assert [row[:3:2] for row in rows] == [["vpg_mpi.py", "CartPole-v1"]] * 4
    busy = ", beside a busy core"
    assert not rows[0][1].endswith("(this checkout)") and rows[1][1].endswith("(this checkout)")
    assert rows[2][1] == rows[0][1] + busy and rows[3][1] == rows[1][1] + busy
    assert rows[0][3] == rows[1][3] and rows[2][3] == rows[3][3]  # one bound for both checkouts, per load
    runs = sorted(path.name for path in (work / "runs").iterdir())
    assert runs == [f"throughput__vpg_mpi__{tag}__0" for tag in ("other", "other__busy", "this", "this__busy")]
    beside = common.table_rows(text.split("## This checkout beside the other")[1], "script")
    places = ["all usable cores (the defaults)", "beside a busy core"]
    assert [row[:3] for row in beside] == [["vpg_mpi.py", "CartPole-v1", place] for place in places]
    for row, (other, this) in zip(beside, [rows[:2], rows[2:]], strict=True):
        assert row[3:5] == [other[4], this[4]]  # each checkout's SPS, as in the table above
        sps = [float(cell.replace(",", "")) for cell in row[3:5]]
        assert float(row[5]) == pytest.approx(sps[1] / sps[0], abs=0.002)
        assert float(row[6]) == pytest.approx(float(row[5]), abs=0.002)  # one round: its ratio is the median


def test_the_two_checkouts_swap_places_every_round_and_the_other_rows_follow_them():
    other = throughput.Contender("b0d01c8", "other", ("python", "before/vpg_mpi.py"))
    this = throughput.Contender("HEAD", "this", ("python", "vpg_mpi.py"))
    variant = throughput.Contender("HEAD --compile", "compile", ("python", "vpg_mpi.py", "--compile"), "variant")
    assert throughput.in_turn([other, this, variant], 0) == [other, this, variant]
    assert throughput.in_turn([other, this, variant], 1) == [this, other, variant]
    assert throughput.in_turn([this, variant], 1) == [this, variant]


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


def test_cleanrl_runs_beside_ours_at_the_defaults_and_on_one_core_with_one_thread(tmp_path):
    """CleanRL's file, found in a checkout, runs after ours in every setting on the same env and batch, its SPS counted
    as ours from its events; the comparison's ratios follow from the two rows."""
    checkout = tmp_path / "cleanrl"
    (checkout / "cleanrl").mkdir(parents=True)
    (checkout / "cleanrl" / "ppo_continuous_action.py").write_text(CLEANRL_STAND_IN)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "stand-in"]):
        subprocess.run([*git, *command], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    work = tmp_path / "work"
    argv = ["--scripts", "ppo_continuous_mpi.py", "--cleanrl", str(checkout), "--cores", "all", "one", "--variants"]
    argv += ["--iterations", "2", "--local-steps", "64", "--env-seconds", "0.1", "--max-load", "1000"]
    text = throughput.main([*argv, "--out", str(tmp_path / "vs"), "--out-dir", str(work)]).read_text()
    assert f"cleanrl/ppo_continuous_action.py (CleanRL {commit}), each run as `python benchmark/cleanrl_compat" in text
    rows = common.table_rows(text, "script")
    ours, theirs = f"{common.code_version(short=True)} (this checkout)", f"CleanRL {commit} ppo_continuous_action.py"
    one_core = ", one core, one thread"
    assert [row[1] for row in rows] == [ours, theirs, ours + one_core, theirs + one_core]
    assert rows[0][3] == rows[1][3] and rows[2][3] == rows[3][3]  # one bound per setting
    assert rows[1][6:10] == rows[3][6:10] == ["", "", "", ""]  # CleanRL's file: no target, no time split logged
    for row, tag in zip(rows, ["this", "cleanrl", "this__one_core", "cleanrl__one_core"], strict=True):
        [run_dir] = (work / "runs").glob(f"*throughput__ppo_continuous_mpi__{tag}__0*")
        (wall_1, step_1, _), (wall_2, step_2, _) = common.read_scalar_events(run_dir)["charts/SPS"]
        assert step_2 - step_1 == 64  # --local-steps for both, under each one's flag names
        assert row[4] == f"{64 / (wall_2 - wall_1):,.0f}"
        assert_ratio(row[5], row[4], row[3])
        command = (work / "logs" / f"throughput__ppo_continuous_mpi__{tag}__0.log").read_text().splitlines()[0]
        assert (f"taskset -c {common.usable_cores()[0]} env OMP_NUM_THREADS=1 " in command) == tag.endswith("one_core")
    log = (work / "logs" / "throughput__ppo_continuous_mpi__cleanrl__one_core__0.log").read_text()
    assert f"torch threads 1, cores [{common.usable_cores()[0]}]" in log
    comparison = common.table_rows(text, "script | CleanRL file")
    assert [row[3] for row in comparison] == ["all usable cores (the defaults)", "one core, one thread"]
    for row, our_row, their_row in zip(comparison, rows[0::2], rows[1::2], strict=True):
        assert row[:3] == ["ppo_continuous_mpi.py", "ppo_continuous_action.py", "HalfCheetah-v5"]
        assert row[4:6] == [our_row[4], their_row[4]]
        assert_ratio(row[6], row[4], row[5])
        assert row[7] == f"{row[6]} - {row[6]}"  # one round: its lowest ratio is its highest


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="iterations >= 2"):
        throughput.main(["--iterations", "1", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="variant's first word"):
        throughput.main(["--variants", "ppo_atari.py --bf16", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="holds no CleanRL ppo_continuous_action.py or ppo_atari.py"):
        throughput.main(["--cleanrl", str(tmp_path), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="has no vpg_mpi.py"):
        throughput.main(["--scripts", "vpg_mpi.py", "--compare-with", str(tmp_path), "--out", str(tmp_path / "x")])
    compat = [sys.executable, str(ROOT / "benchmark" / "cleanrl_compat.py"), str(tmp_path / "ppo_atari.py")]
    refused = subprocess.run(compat, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("cleanrl_compat.py: error: give an existing CleanRL")
    assert refused.stderr.count("\n") == 1  # one line, no traceback


@pytest.mark.parametrize(
    ("script", "env_id"),
    [("vpg_mpi.py", "HalfCheetah-v5"), ("vpg_mpi.py", "CartPole-v1"), ("ppo_continuous_mpi.py", "HalfCheetah-v5")],
)
def test_numpy_rollout_policy_acts_as_the_torch_modules_and_follows_updates_and_loads(script, env_id):
    """The numpy rollout policy (numpy views of the parameters) against the nn.Sequential modules and the
    log-probabilities the update computes, after an optimizer step and a load_state_dict made with the policy built."""
    import gymnasium as gym

    module = common.load_script(script)
    env = gym.make(env_id)
    obs_dim = env.observation_space.shape[0]
    torch.manual_seed(0)
    if script == "vpg_mpi.py":
        agent, other = (module.Agent(obs_dim, env.action_space, (64, 64)) for _ in range(2))
        actor, critic = agent.actor, agent.critic

        def log_prob_of(obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
            return agent.log_prob_entropy(obs, actions)[0]
    else:
        agent, other = (module.Agent(obs_dim, env.action_space.shape[0]) for _ in range(2))
        actor, critic = agent.actor_mean, agent.critic

        def log_prob_of(obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
            return agent.log_prob_entropy_value(obs, actions)[0]

    policy = agent.rollout_policy()
    obs = torch.randn(5, obs_dim)
    for change in ("none", "step", "load"):
        if change == "step":
            optimizer = torch.optim.Adam(agent.parameters(), lr=0.1)
            sum(p.sum() for p in agent.parameters()).backward()
            optimizer.step()
        elif change == "load":
            agent.load_state_dict(other.state_dict())
        with torch.no_grad():
            expected_out, expected_value = actor(obs), critic(obs).squeeze(-1)
        np.random.seed(1)
        actions, log_prob, value = policy.act(obs.numpy())
        np.random.seed(1)
        assert np.array_equal(policy.act(obs.numpy())[0], actions), change  # reproducible from numpy's seed
        np.testing.assert_allclose(value, expected_value.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
        with torch.no_grad():  # the rollout's log-probabilities are the update's: PPO's ratio starts at 1
            expected_log_prob = log_prob_of(obs, torch.as_tensor(actions, dtype=torch.float32)).numpy()
        np.testing.assert_allclose(log_prob, expected_log_prob, rtol=1e-5, atol=1e-5, err_msg=change)
        mode = policy.act(obs.numpy(), deterministic=True)[0]
        expected_mode = expected_out.argmax(-1) if env_id == "CartPole-v1" else expected_out
        np.testing.assert_allclose(mode, expected_mode.numpy(), rtol=1e-5, atol=1e-5, err_msg=change)
    if env_id == "CartPole-v1":  # sampled actions follow the softmax (made far from uniform first)
        with torch.no_grad():  # logits 0 and log 3 at every observation: probabilities 1/4 and 3/4, whatever the init
            actor[-1].weight.zero_()
            actor[-1].bias.copy_(torch.tensor([0.0, np.log(3.0)]))
        probabilities = torch.softmax(actor(obs[:1]), -1)[0].detach().numpy()
        assert 0.1 < probabilities[0] < 0.4 or 0.6 < probabilities[0] < 0.9, probabilities
        np.random.seed(2)
        draws = policy.act(np.repeat(obs[:1].numpy(), 20_000, axis=0))[0]
        np.testing.assert_allclose(np.bincount(draws, minlength=2) / len(draws), probabilities, atol=0.015)
