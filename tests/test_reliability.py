"""Checkpoints and elastic restarts, SIGTERM, dead peers, ranks that disagree, bad input. The restart, the stop and
the checks are ddrl's, the same for every script: a run of VPG's shows them; the update each script writes itself
meets a non-finite loss in each script's own."""

import importlib
import os
import re
import signal
import sys

import gymnasium as gym
import pytest
import torch
import torch.distributed as dist

import vpg_mpi
from benchmark import faults
from ddrl import in_sync
from ddrl.failures import NonFiniteError
from tests.helpers import (
    RANK_ENTRY,
    ROOT,
    WAIT,
    assert_ok,
    finish,
    finish_python,
    free_port,
    output,
    progress_lines,
    read_checkpoint,
    read_scalars,
    refuse,
    run_dirs,
    run_ranks,
    start,
    start_python,
    tiny_flags,
    torchrun_with,
    train_rank_signalled,
    train_ranks,
    wait_for,
    world_batch,
    write_checkpoint,
)

VPG = "vpg_mpi.py"
ITERATIONS = 4  # of the interrupted runs and of the uninterrupted one they are compared with
BATCH = world_batch(VPG)


def module(script: str):
    return importlib.import_module(script.removesuffix(".py"))


def logged_steps(run_dir) -> list[int]:
    return [step for step, _ in read_scalars(run_dir)["charts/SPS"]]


def checkpoints(cwd) -> list:
    return sorted(cwd.glob("runs/*/checkpoints/iter_*.safetensors"))


# --- checkpoints, elastic restart, SIGTERM -------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The final checkpoint of an uninterrupted two-rank run of ITERATIONS iterations, which the interrupted runs
    must end with the random streams of."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    train_ranks(VPG, tiny_flags(VPG, ITERATIONS, "--checkpoint-every", str(ITERATIONS)), cwd)
    return read_checkpoint(checkpoints(cwd)[-1])


def assert_random_streams_went_on(final: dict, uninterrupted: dict, restarts: int) -> None:
    """Every rank's random streams went on from the checkpoint as if never interrupted: they match the uninterrupted
    run's at the end (the weights differ: the envs restarted from fresh episodes)."""
    assert final["iteration"] == uninterrupted["iteration"] == ITERATIONS and final["restarts"] == restarts
    assert final["global_step"] == uninterrupted["global_step"] == ITERATIONS * BATCH
    streams = [name for name in uninterrupted["tensors"] if name.startswith("rng.")]
    assert len(streams) == 5 and all(uninterrupted["tensors"][name].shape[0] == 2 for name in streams), streams
    for name in streams:  # bit for bit (Python's cached gaussian is NaN where there is none)
        assert final["tensors"][name].numpy().tobytes() == uninterrupted["tensors"][name].numpy().tobytes(), name
    assert not torch.equal(final["tensors"]["rng.torch"][0], final["tensors"]["rng.torch"][1])


def test_a_killed_worker_restarts_the_group_which_resumes_from_its_checkpoint(uninterrupted, tmp_path):
    """torchrun --max-restarts 1 (no --run-name: the rendezvous id names the run); rank 1 of the first attempt dies
    by SIGKILL once checkpoint 2 is written, and rank 0 meets the death in iteration 3's update."""
    run_flags = tiny_flags(VPG, ITERATIONS, "--checkpoint-every", "1", "--save-model")
    command = torchrun_with(
        ["--standalone", "--max-restarts", "1"], str(RANK_ENTRY.relative_to(ROOT)), [VPG, *run_flags]
    )
    result = finish(start(command, tmp_path, DDRL_TEST_KILL="1:2"), 240)
    assert_ok(result)

    # one run folder, found again by the restarted ranks; it resumed from checkpoint 2, not from scratch
    [run_dir] = run_dirs(tmp_path)
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resuming from ")]
    assert resumed == ["resuming from runs/" + run_dir.name + "/checkpoints/iter_000002.safetensors"], result.stdout
    # the lost attempt stopped within iteration 3, which the restarted one trained
    assert progress_lines(result.stdout) == [1, 2, 3, 4], result.stdout
    assert f"{VPG}: error: rank 0: lost contact with another rank" in result.stderr, result.stderr[-3000:]
    # TensorBoard continues at the restored step: every iteration logged once, none from the lost attempt
    assert logged_steps(run_dir) == [BATCH * i for i in range(1, ITERATIONS + 1)]
    assert (run_dir / "model.safetensors").exists()
    assert_random_streams_went_on(read_checkpoint(checkpoints(tmp_path)[-1]), uninterrupted, restarts=1)


def test_sigterm_checkpoints_and_stops_every_rank_and_resume_finishes_the_run(uninterrupted, tmp_path):
    """A preemption notice to rank 1 alone, once it has logged iteration 1: both ranks agree to stop after the next
    one, with a checkpoint; --resume (no torchrun needed: the ranks run main alike) finishes the run."""
    run_flags = tiny_flags(VPG, ITERATIONS, "--run-name", "preempted")
    _, result = train_ranks(VPG, run_flags, tmp_path, worker=train_rank_signalled, DDRL_TEST_SIGTERM="1:1")
    stopped = "stopped by SIGTERM or Ctrl-C on another rank at epoch 2; continue with --resume --run-name preempted"
    assert stopped in result.stdout.splitlines() and progress_lines(result.stdout) == [1, 2], result.stdout
    run_dir = tmp_path / "runs" / "preempted"
    assert [path.name for path in checkpoints(tmp_path)] == ["iter_000002.safetensors"]
    assert not (run_dir / "model.safetensors").exists()
    summary = f"stopped: {BATCH * 2} env steps in "  # the last line sums the run up and says how on
    assert result.stdout.splitlines()[-1].startswith(summary), result.stdout[-500:]
    assert "; TensorBoard run runs/preempted; continue with --resume --run-name preempted" in result.stdout

    resume_flags = [*run_flags, "--resume", "--save-model", "--checkpoint-every", str(ITERATIONS)]
    _, result = train_ranks(VPG, resume_flags, tmp_path)
    assert progress_lines(result.stdout) == [3, 4]
    assert logged_steps(run_dir) == [BATCH * i for i in range(1, ITERATIONS + 1)]
    assert read_checkpoint(run_dir / "model.safetensors")["script"] == VPG
    summary = re.fullmatch(
        r"done: (\d+) env steps in \d+:\d\d, last return (\S+); TensorBoard run (\S+), model (\S+)",
        result.stdout.splitlines()[-1],
    )
    assert summary and int(summary[1]) == BATCH * ITERATIONS, result.stdout[-500:]
    returns = re.findall(r"^epoch \d+/\d+ step \d+ SPS \d+ return (\S+) ", result.stdout, re.MULTILINE)
    assert summary[2] == ([value for value in returns if value != "n/a"] or ["n/a"])[-1]  # the last one logged
    assert (tmp_path / summary[3]) == run_dir and (tmp_path / summary[4]) == run_dir / "model.safetensors"
    assert_random_streams_went_on(read_checkpoint(checkpoints(tmp_path)[-1]), uninterrupted, restarts=1)


# --- a dead or silent peer never hangs the others ------------------------------------------------------


def start_ranks(args: list[str], cwd, scripts: tuple | None = None, rank_args: tuple = ((), ())) -> list:
    """Two ranks launched by hand (no torchrun), as a user or a cluster without one would: `scripts` (the rank's
    copy of the script) and `rank_args` (added to its flags) per rank."""
    port = str(free_port())
    processes = []
    for rank in range(2):
        path = scripts[rank] if scripts else ROOT / VPG
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        processes.append(start_python(path, [*args, *rank_args[rank]], cwd, f"rank{rank}", **env))
    return processes


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "silent"])
def test_a_dead_or_silent_peer_stops_the_survivor_within_the_timeout(sig, tmp_path):
    """The survivor ends in one line naming --dist-timeout, long before the default (1800 s) would end its wait."""
    timeout = 5  # seconds, the least --dist-timeout takes; a healthy collective of these tiny runs takes milliseconds
    ranks = start_ranks(tiny_flags(VPG, 10**6, "--dist-timeout", str(timeout)), tmp_path)  # ends only as killed
    try:
        wait_for(lambda: progress_lines(output(ranks[0])[0]), WAIT, "the first iteration", tuple(ranks))
        os.kill(ranks[1].pid, sig)
        result = finish_python(ranks[0], WAIT)
    finally:
        ranks[1].kill()
        ranks[1].join()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [message] = [line for line in result.stderr.splitlines() if "error" in line]
    assert message.startswith(f"{VPG}: error: rank 0: lost contact with another rank"), message
    assert f"--dist-timeout {timeout} s" in message and "--resume" in message


def ended(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie that nobody reaped yet)."""
    return faults.state(pid) in ("", "Z")


def test_a_killed_torchrun_agent_ends_every_worker_in_one_line_naming_it(tmp_path):
    """SIGKILL to the torchrun agent once its two workers train (a run of hours, no checkpoint due): each worker
    notices at its next iteration that the agent, and the store it served, are gone, and ends in one line naming the
    agent, with no traceback and none of torch's dumps of a store that no longer answers."""
    flags = tiny_flags(VPG, 10**5)
    launcher = start(torchrun_with(["--standalone"], VPG, flags), tmp_path)
    workers = []
    try:
        wait_for(lambda: progress_lines(output(launcher)[0]), WAIT, "the first epoch", (launcher,))
        workers = faults.rank_pids(launcher.pid)
        assert len(workers) == 2, workers
        launcher.kill()
        launcher.wait()
        wait_for(lambda: all(ended(pid) for pid in workers), WAIT, "the workers ending after their agent was killed")
    finally:
        for pid in workers:
            if pid and not ended(pid):
                os.kill(pid, signal.SIGKILL)
    stdout, stderr = output(launcher)
    assert "Traceback" not in stderr and "Broken pipe" not in stderr, stderr[-3000:]
    errors = sorted(line for line in stderr.splitlines() if ": error: " in line)
    assert len(errors) == 2, errors
    for rank, message in enumerate(errors):
        assert message.startswith(
            f"{VPG}: error: rank {rank}: the torchrun agent exited, taking its store: every rank stops; resume with "
            "--resume --run-name "
        ), message
    assert progress_lines(stdout) and progress_lines(stdout)[-1] < 10**5


# --- ranks that disagree -------------------------------------------------------------------------------


def test_ranks_with_an_edited_copy_or_other_arguments_stop_before_training(tmp_path):
    edited = tmp_path / "node1" / VPG
    edited.parent.mkdir()
    edited.write_text((ROOT / VPG).read_text() + "\n# edited on node 1\n")
    for scripts, rank_args, problem in (
        ((ROOT / VPG, edited), ((), ()), f"ranks [1] run a different copy of {VPG} than rank 0"),
        (None, ((), ("--seed", "2")), "ranks [1] were given different arguments than rank 0"),
    ):
        ranks = start_ranks(tiny_flags(VPG, 2), tmp_path, scripts, rank_args)
        results = [finish_python(process, 120) for process in ranks]
        assert [r.returncode for r in results] == [2, 2], [r.stderr for r in results]
        [message] = [line for line in results[0].stderr.splitlines() if ": error: " in line]  # mujoco may warn
        assert message == f"{VPG}: error: {problem}; " + (
            "copy the same script to every node" if scripts else "launch every rank with the same command line"
        )
        assert "Traceback" not in results[1].stderr and not progress_lines(results[0].stdout)
        assert not (tmp_path / "runs").exists()


class Spaces:
    """What an Agent reads of its envs: their single observation and action spaces."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space):
        self.single_observation_space = observation_space
        self.single_action_space = action_space


SYNC_CASES = ("equal", "a parameter", "a buffer", "an optimizer option", "a number in args")


def disagreement_rank(rank: int, world_size: int, folder: str) -> dict:
    """check_in_sync on a module, its Adam and args that agree, then that differ on rank 1 in one thing each (a few
    ulps of a weight, a statistic, the learning rate, a coefficient): each in a group of its own, as each stops it."""
    outcome = {}
    for case in SYNC_CASES:
        dist.init_process_group(
            "gloo", store=dist.FileStore(f"{folder}/{SYNC_CASES.index(case)}", 2), rank=rank, world_size=2
        )
        torch.manual_seed(0)
        layer = torch.nn.BatchNorm1d(3)  # weights, and statistics in buffers
        optimizer = torch.optim.Adam(layer.parameters(), lr=0.01)
        args = vpg_mpi.Args()
        if rank == 1:
            with torch.no_grad():
                if case == "a parameter":
                    layer.bias[0] += 1e-6
                elif case == "a buffer":
                    layer.running_mean[0] += 1e-6
            if case == "an optimizer option":
                optimizer.param_groups[0]["lr"] = 0.02
            elif case == "a number in args":
                args.gamma = 0.98
        try:
            in_sync.check_in_sync(1, "iteration", sys._getframe(), args, torch.device("cpu"))
            outcome[case] = "passed"
        except SystemExit as stop:
            outcome[case] = stop.code
        if dist.is_initialized():
            dist.destroy_process_group()
    return outcome


def test_ranks_whose_training_state_differs_in_anything_stop_every_rank(tmp_path):
    """The sync check covers the weights, the statistics in buffers, the optimizer's options and the numbers in args:
    a difference in any one of them, on one rank, stops every rank; agreement passes."""
    expected = {case: 2 for case in SYNC_CASES} | {"equal": "passed"}
    for rank, outcome in enumerate(run_ranks(disagreement_rank, 2, tmp_path, str(tmp_path), join_group=False)):
        assert outcome == expected, (rank, outcome)


def nonfinite_update(script: str, rank: int) -> tuple[str, bool]:
    """Run the script's update on a batch that is NaN on rank 1 only (observations for VPG, whose policy step comes
    first; value targets for PPO); who raises, and were the weights left alone (no rank stepped)?"""
    algorithm = module(script)
    torch.distributions.Distribution.set_default_validate_args(False)  # as ddrl.launch sets it: NaN reaches the loss
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
    box = gym.spaces.Box(-1.0, 1.0, (4,))
    if script == VPG:
        agent = algorithm.Agent(Spaces(box, gym.spaces.Box(-1.0, 1.0, (2,))), (8,))
        batch["obs"][3] += poison
        policy = [p for name, p in agent.named_parameters() if not name.startswith("critic.")]
        groups = [{"params": policy, "lr": 0.01}, {"params": list(agent.critic.parameters()), "lr": 0.01}]
        optimizer = torch.optim.Adam(groups)
        arguments = (agent, optimizer, batch, algorithm.Args(train_v_iters=2))
    else:
        args = algorithm.Args(num_minibatches=2, update_epochs=2)
        orders = torch.stack([torch.randperm(16), torch.randperm(16)])
        sizes = algorithm.minibatch_sizes([16, 16], 2)
        batch["returns"] += poison  # every minibatch: the first step must already be refused
        if script == "ppo_continuous_mpi.py":
            agent = algorithm.Agent(Spaces(box, gym.spaces.Box(-1.0, 1.0, (2,))))
            optimizer = torch.optim.Adam(agent.parameters(), lr=0.01)
            arguments = (agent, optimizer, batch, args, orders, sizes)
        else:
            agent = algorithm.Agent(Spaces(gym.spaces.Box(0, 255, (4, 84, 84)), gym.spaces.Discrete(4)))
            batch["obs"] = torch.randint(0, 255, (16, 4, 84, 84), dtype=torch.uint8)
            batch["actions"] = torch.randint(0, 4, (16,))
            optimizer = torch.optim.Adam(agent.parameters(), lr=0.01)
            model = torch.nn.parallel.DistributedDataParallel(algorithm.ActionAndValue(agent))
            arguments = (model, optimizer, batch, args, orders, sizes, algorithm.minibatch_loss)
    before = {key: value.clone() for key, value in agent.state_dict().items()}
    try:
        algorithm.update(*arguments)
        raised = "no"
    except NonFiniteError:
        raised = "NonFiniteError"
    unchanged = all(torch.equal(before[key], value) for key, value in agent.state_dict().items())
    return raised, unchanged


def nonfinite_rank(rank: int, world_size: int, script: str) -> tuple[str, bool]:
    return nonfinite_update(script, rank)


@pytest.mark.parametrize("script", ["vpg_mpi.py", "ppo_continuous_mpi.py", "ppo_atari_multigpu.py"])
def test_a_non_finite_loss_on_one_rank_stops_every_rank_before_any_step(script, tmp_path):
    for rank, outcome in enumerate(run_ranks(nonfinite_rank, 2, tmp_path, script)):
        assert outcome == ("NonFiniteError", True), (rank, outcome)


# --- bad input: one clear message before any env, nothing written ---------------------------------------


BAD_INPUT = [
    (["--checkpoint-every", "-1"], {}, False, "--checkpoint-every must be at least 0, got -1"),
    (["--check-sync-every", "-2"], {}, False, "--check-sync-every must be at least 0, got -2"),
    (["--resume"], {}, False, "--resume needs a run folder that every (re)started rank finds again: pass --run-name"),
    (
        [],
        {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RUN_ID": "none"},
        False,
        "torchrun --max-restarts needs a run folder that every (re)started rank finds again: pass --run-name NAME",
    ),
    (["--resume", "--run-name", "new"], {}, False, "--resume found no checkpoint in runs/new/checkpoints"),
    (["--run-name", "old"], {}, True, "runs/old already exists: pass --resume to continue it"),
    (["--dist-timeout", "0"], {}, False, "--dist-timeout must be at least 5, got 0.0"),
]


@pytest.mark.parametrize(("extra", "env", "checkpoint", "message"), BAD_INPUT)
def test_bad_reliability_input_is_one_clear_message(
    extra, env, checkpoint, message, saved, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    if checkpoint:
        write_checkpoint(saved(VPG)[0], tmp_path / "runs/old/checkpoints/iter_000002.safetensors")
    assert message in refuse(vpg_mpi, tiny_flags(VPG, 2, *extra), monkeypatch, capsys, **env)
    written = sorted(path.name for path in tmp_path.glob("runs/**/*") if path.is_file())
    assert written == (["iter_000002.safetensors"] if checkpoint else []), written
