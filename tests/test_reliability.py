"""For every script: checkpoints and elastic restarts, SIGTERM, dead peers, ranks that disagree, bad input."""

import importlib
import os
import re
import signal
import sys
import time

import gymnasium as gym
import pytest
import torch
import torch.distributed as dist

from ddrl import checks
from ddrl.failures import NonFiniteError
from tests.helpers import (
    ROOT,
    assert_ok,
    finish,
    free_port,
    output,
    progress_lines,
    read_checkpoint,
    read_scalars,
    refuse,
    run_dirs,
    run_ranks,
    signal_rank_when,
    start,
    torchrun_with,
    train_ranks,
    wait_for,
    write_checkpoint,
)

# tiny runs on 2 ranks: (flags, global env steps of one iteration)
SCRIPTS = {
    "vpg_mpi.py": (["--env-id", "CartPole-v1", "--steps-per-epoch", "1000", "--train-v-iters", "5"], 1000),
    "ppo_continuous_mpi.py": (
        ["--env-id", "HalfCheetah-v5", "--num-steps", "256", "--num-minibatches", "4", "--update-epochs", "2"],
        512,
    ),
    "ppo_atari_multigpu.py": (
        ["--env-id", "BreakoutNoFrameskip-v4", "--local-num-envs", "2", "--num-steps", "32"]
        + ["--num-minibatches", "2", "--update-epochs", "1"],
        128,
    ),
}


# each script, and the modes whose update runs elsewhere: --sync gather (rank 0 learns alone)
CASES = [*((script, ()) for script in SCRIPTS), ("ppo_continuous_mpi.py", ("--sync", "gather"))]
CASE_IDS = [script + "".join(f" {flag}" for flag in mode) for script, mode in CASES]


def flags(script: str, iterations: int, *extra: str) -> list[str]:
    script_flags, batch = SCRIPTS[script]
    return [*script_flags, "--total-timesteps", str(iterations * batch), *extra]


def logged_steps(run_dir) -> list[int]:
    return [step for step, _ in read_scalars(run_dir)["charts/SPS"]]


def checkpoints(cwd) -> list:
    return sorted(cwd.glob("runs/*/checkpoints/iter_*.safetensors"))


# --- checkpoints, elastic restart, SIGTERM -------------------------------------------------------------

ITERATIONS = 8  # of the interrupted runs and of the uninterrupted one they are compared with


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(script, mode) -> the final checkpoint of an uninterrupted ITERATIONS-iteration run, made once per case for the
    tests whose interrupted runs must end with its random streams."""
    finals = {}

    def final_checkpoint(script: str, mode: tuple) -> dict:
        if (script, mode) not in finals:
            cwd = tmp_path_factory.mktemp("uninterrupted")
            run_flags = flags(script, ITERATIONS, "--checkpoint-every", str(ITERATIONS), *mode)
            train_ranks(script, run_flags, cwd)
            finals[script, mode] = read_checkpoint(checkpoints(cwd)[-1])
        return finals[script, mode]

    return final_checkpoint


def assert_random_streams_went_on(final: dict, uninterrupted: dict, restarts: int) -> None:
    """Every rank's random streams went on from the checkpoint as if never interrupted: they match the uninterrupted
    run's at the end (the weights differ: the envs restarted from fresh episodes)."""
    assert final["iteration"] == uninterrupted["iteration"] == ITERATIONS and final["restarts"] == restarts
    assert final["global_step"] == uninterrupted["global_step"]
    for rank in range(2):
        torch_stream = f"rng.{rank}.torch"
        assert torch.equal(final["tensors"][torch_stream], uninterrupted["tensors"][torch_stream]), rank
        assert final["rng"][rank] == uninterrupted["rng"][rank], rank  # Python's and numpy's
    assert not torch.equal(final["tensors"]["rng.0.torch"], final["tensors"]["rng.1.torch"])


@pytest.mark.parametrize(("script", "mode"), CASES, ids=CASE_IDS)
def test_a_killed_worker_restarts_the_group_which_resumes_from_its_checkpoint(script, mode, uninterrupted, tmp_path):
    """torchrun --max-restarts 1 (no --run-name: the rendezvous id names the run), SIGKILL rank 1 after checkpoint 2."""
    iterations, batch, killed = ITERATIONS, SCRIPTS[script][1], tmp_path
    run_flags = flags(script, iterations, "--checkpoint-every", "1", "--save-model", *mode)
    launcher = start(torchrun_with(["--standalone", "--max-restarts", "1"], script, run_flags), killed)
    signal_rank_when(
        launcher, 1, signal.SIGKILL, lambda: any(path.name == "iter_000002.safetensors" for path in checkpoints(killed))
    )
    result = finish(launcher, 240)
    assert_ok(result)

    # one run folder, found again by the restarted ranks; it resumed from a checkpoint, not from scratch
    [run_dir] = run_dirs(killed)
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resuming from ")]
    assert len(resumed) == 1, result.stdout
    resumed_at = int(resumed[0].split("iter_")[1].split(".safetensors")[0])
    lines = progress_lines(result.stdout)
    assert 2 <= resumed_at < iterations and lines.count(1) == 1 and lines[-1] == iterations, result.stdout
    # at most one iteration (--checkpoint-every 1) was trained twice
    assert sorted(set(lines)) == list(range(1, iterations + 1)) and len(lines) - iterations <= 1, lines
    # TensorBoard continues at the restored step: every iteration logged once, none from the lost attempt
    assert logged_steps(run_dir) == [batch * i for i in range(1, iterations + 1)]
    assert (run_dir / "model.safetensors").exists()

    final = read_checkpoint(checkpoints(killed)[-1])
    assert final["global_step"] == iterations * batch
    assert_random_streams_went_on(final, uninterrupted(script, mode), restarts=1)


@pytest.mark.parametrize(("script", "mode"), CASES, ids=CASE_IDS)
def test_sigterm_checkpoints_and_stops_every_rank_and_resume_finishes_the_run(script, mode, uninterrupted, tmp_path):
    iterations, batch = ITERATIONS, SCRIPTS[script][1]
    run_flags = flags(script, iterations, "--run-name", "preempted", *mode)
    # a preemption notice to one rank only, after rank 0's first iteration: both must agree to stop at the same one
    rank0_output = tmp_path / "rank0.out"
    first_iteration = (1, signal.SIGTERM, lambda: rank0_output.exists() and progress_lines(rank0_output.read_text()))
    _, result = train_ranks(script, run_flags, tmp_path, timeout=180, signal_rank=first_iteration)
    stopped = re.findall(
        r"^stopped by [^;]+ on another rank at (?:epoch|iteration) (\d+);", result.stdout, re.MULTILINE
    )
    assert len(stopped) == 1, result.stdout
    stopped_at = int(stopped[0])
    assert 1 <= stopped_at < iterations and progress_lines(result.stdout)[-1] == stopped_at
    run_dir = tmp_path / "runs" / "preempted"
    assert [path.name for path in checkpoints(tmp_path)] == [f"iter_{stopped_at:06d}.safetensors"]
    assert not (run_dir / "model.safetensors").exists()
    summary = f"stopped: {batch * stopped_at} env steps in "  # the last line sums the run up and says how on
    assert result.stdout.splitlines()[-1].startswith(summary), result.stdout[-500:]
    assert "; TensorBoard run runs/preempted; continue with --resume --run-name preempted" in result.stdout

    resume_flags = [*run_flags, "--resume", "--save-model", "--checkpoint-every", str(iterations)]
    _, result = train_ranks(script, resume_flags, tmp_path)  # a resume needs no torchrun: the ranks run main alike
    assert progress_lines(result.stdout) == list(range(stopped_at + 1, iterations + 1))
    assert logged_steps(run_dir) == [batch * i for i in range(1, iterations + 1)]
    assert read_checkpoint(run_dir / "model.safetensors")["script"] == script
    summary = re.fullmatch(
        r"done: (\d+) env steps in \d+:\d\d, last return (\S+); TensorBoard run (\S+), model (\S+)",
        result.stdout.splitlines()[-1],
    )
    assert summary and int(summary[1]) == batch * iterations, result.stdout[-500:]
    returns = re.findall(r"^(?:epoch|iteration) \d+/\d+ step \d+ SPS \d+ return (\S+) ", result.stdout, re.MULTILINE)
    assert summary[2] == ([value for value in returns if value != "n/a"] or ["n/a"])[-1]  # the last one logged
    assert (tmp_path / summary[3]) == run_dir and (tmp_path / summary[4]) == run_dir / "model.safetensors"
    assert_random_streams_went_on(read_checkpoint(checkpoints(tmp_path)[-1]), uninterrupted(script, mode), restarts=1)


# --- a dead or silent peer never hangs the others ------------------------------------------------------


def start_ranks(script: str, args: list[str], cwd, scripts: tuple | None = None, rank_args: tuple = ((), ())) -> list:
    """Two ranks launched by hand (no torchrun), as a user or a cluster without one would."""
    port = str(free_port())
    processes = []
    for rank in range(2):
        path = scripts[rank] if scripts else ROOT / script
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        processes.append(start([sys.executable, str(path), *args, *rank_args[rank]], cwd, f"rank{rank}", **env))
    return processes


@pytest.mark.parametrize(
    ("script", "sig", "mode"),
    [
        pytest.param(script, signal.SIGKILL, mode, id=f"{case}-SIGKILL")
        for (script, mode), case in zip(CASES, CASE_IDS, strict=True)
    ]
    + [pytest.param("vpg_mpi.py", signal.SIGSTOP, (), id="vpg_mpi.py-SIGSTOP")],
)
def test_a_dead_or_silent_peer_stops_the_survivor_within_the_timeout(script, sig, mode, tmp_path):
    timeout = 6  # seconds; a healthy collective of these tiny runs takes milliseconds
    ranks = start_ranks(script, flags(script, 50, "--dist-timeout", str(timeout), *mode), tmp_path)
    try:
        wait_for(lambda: progress_lines(output(ranks[0])[0]), 120, "the first iteration", tuple(ranks))
        os.kill(ranks[1].pid, sig)
        killed_at = time.monotonic()
        result = finish(ranks[0], timeout + 30)
    finally:
        ranks[1].kill()
    assert time.monotonic() - killed_at < timeout + 10
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [message] = [line for line in result.stderr.splitlines() if "error" in line]
    assert message.startswith(f"{script}: error: rank 0: lost contact with another rank"), message
    assert "--dist-timeout" in message and "--resume" in message


# --- ranks that disagree -------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_ranks_with_an_edited_copy_or_other_arguments_stop_before_training(script, tmp_path):
    edited = tmp_path / "node1" / script
    edited.parent.mkdir()
    edited.write_text((ROOT / script).read_text() + "\n# edited on node 1\n")
    for scripts, rank_args, problem in (
        ((ROOT / script, edited), ((), ()), f"ranks [1] run a different copy of {script} than rank 0"),
        (None, ((), ("--seed", "2")), "ranks [1] were given different arguments than rank 0"),
    ):
        ranks = start_ranks(script, flags(script, 2), tmp_path, scripts, rank_args)
        results = [finish(process, 120) for process in ranks]
        assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
        [message] = [line for line in results[0].stderr.splitlines() if ": error: " in line]  # mujoco may warn
        assert message == f"{script}: error: {problem}; " + (
            "copy the same script to every node" if scripts else "launch every rank with the same command line"
        )
        assert "Traceback" not in results[1].stderr and not progress_lines(results[0].stdout)
        assert not (tmp_path / "runs").exists()


def module(script: str):
    return importlib.import_module(script.removesuffix(".py"))


def disagreement_rank(rank: int, world_size: int, script: str) -> dict:
    """A non-finite loss on rank 1 in update(); then check_weights_in_sync on equal, then unequal weights."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    outcome = dict(zip(("nonfinite", "unchanged"), nonfinite_update(module(script), script, rank), strict=True))
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    checks.check_weights_in_sync(layer, 1)  # equal: passes on every rank
    with torch.no_grad():
        layer.bias[0] += 1e-6 * rank  # a few ulps apart on rank 1
    try:
        checks.check_weights_in_sync(layer, 2)
    except SystemExit as stop:
        outcome["sync"] = stop.code
    if dist.is_initialized():
        dist.destroy_process_group()
    return outcome


def nonfinite_update(algorithm, script: str, rank: int) -> tuple[str, bool]:
    """Run the script's update on a batch that is NaN on rank 1 only (observations for VPG, whose policy step comes
    first; value targets for PPO); who raises, and were the weights left alone (no rank stepped)?"""
    torch.manual_seed(1)
    poison = float("nan") if rank == 1 else 0.0
    batch = {
        "obs": torch.randn(16, 4),
        "actions": torch.randn(16, 2),
        "log_probs": torch.full((16,), -0.7),
        "values": torch.zeros(16),
        "advantages": torch.randn(16),
        "returns": torch.randn(16),
    }
    if script == "vpg_mpi.py":
        agent = algorithm.Agent(4, gym.spaces.Box(-1.0, 1.0, (2,)), (8,))
        batch["obs"][3] += poison
        pi_optimizer = torch.optim.Adam(agent.policy_parameters(), lr=0.01)
        vf_optimizer = torch.optim.Adam(agent.critic.parameters(), lr=0.01)
        step = lambda: algorithm.update(agent, pi_optimizer, vf_optimizer, batch, algorithm.Args(train_v_iters=2))  # noqa: E731
    else:
        if script == "ppo_continuous_mpi.py":
            agent = algorithm.Agent(4, 2)
        else:
            agent = algorithm.Agent(4)
            batch["obs"] = torch.randint(0, 255, (16, 4, 84, 84), dtype=torch.uint8)
            batch["actions"] = torch.randint(0, 4, (16,))
        batch["returns"] += poison  # every minibatch: the first step must already be refused
        args = algorithm.Args(num_minibatches=2, update_epochs=2)
        args.local_batch_size, args.local_minibatch_size = 16, 8
        optimizer = torch.optim.Adam(agent.parameters(), lr=0.01)
        order = torch.stack([torch.randperm(16), torch.randperm(16)])
        if script == "ppo_continuous_mpi.py":
            step = lambda: algorithm.update(agent, optimizer, batch, args, order)  # noqa: E731
        else:
            model = torch.nn.parallel.DistributedDataParallel(agent)
            step = lambda: algorithm.update(model, optimizer, batch, args, order)  # noqa: E731
    before = {key: value.clone() for key, value in agent.state_dict().items()}
    try:
        step()
        raised = "no"
    except NonFiniteError:
        raised = "NonFiniteError"
    unchanged = all(torch.equal(before[key], value) for key, value in agent.state_dict().items())
    return raised, unchanged


@pytest.mark.parametrize("script", SCRIPTS)
def test_weights_out_of_sync_or_a_non_finite_loss_on_one_rank_stop_every_rank(script, tmp_path):
    for rank, outcome in enumerate(run_ranks(disagreement_rank, 2, tmp_path, script, join_group=False)):
        assert outcome == {"sync": 2, "nonfinite": "NonFiniteError", "unchanged": True}, (rank, outcome)


# --- bad input: one clear message before any env, nothing written ---------------------------------------


def foreign_checkpoint(tmp_path, script: str, changes: dict) -> None:
    """A file in runs/old/checkpoints named as `script` names its checkpoints (what it holds: test_checkpoints.py)."""
    header = {"script": script, "env_id": SCRIPTS[script][0][1], "iteration": 1, "world_size": 1, **changes}
    write_checkpoint({**header, "tensors": {}}, tmp_path / "runs" / "old" / "checkpoints" / "iter_000001.safetensors")


BAD_INPUT = [
    (["--checkpoint-every", "-1"], {}, None, "--checkpoint-every and --check-sync-every must be >= 0"),
    (["--check-sync-every", "-2"], {}, None, "--checkpoint-every and --check-sync-every must be >= 0"),
    (["--resume"], {}, None, "--resume needs a run folder that every (re)started rank finds again: pass --run-name"),
    (
        [],
        {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "none"},
        None,
        "torchrun --max-restarts needs a run folder that every (re)started rank finds again: pass --run-name NAME",
    ),
    (["--resume", "--run-name", "new"], {}, None, "--resume found no checkpoint in runs/new/checkpoints"),
    (["--run-name", "old"], {}, {}, "runs/old already exists: pass --resume to continue it"),
    (["--dist-timeout", "0"], {}, None, "--dist-timeout"),
]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(("extra", "env", "checkpoint", "message"), BAD_INPUT)
def test_bad_reliability_input_is_one_clear_message(
    script, extra, env, checkpoint, message, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    if checkpoint is not None:
        foreign_checkpoint(tmp_path, script, checkpoint)
    assert message in refuse(module(script), [*flags(script, 2), *extra], monkeypatch, capsys, **env)
    written = sorted(path.name for path in tmp_path.glob("runs/**/*") if path.is_file())
    assert written == (["iter_000001.safetensors"] if checkpoint is not None else []), written
