"""Checkpoints, for every script: one safetensors file of tensors and a JSON header, so reading one runs no code. A
file is recognised by what it holds: a copy of a script loads the original's where its Agent and optimizer fit (and
says whose it is), keeping the command line's optimizer options; anything that does not fit, resumed or evaluated,
ends in one line naming the file, who wrote it and the misfit. A round trip restores every tensor and random stream."""

import dataclasses
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddrl import checkpoints, launching
from tests.helpers import ROOT, assert_ok, read_checkpoint, refuse, run_command, train_ranks, write_checkpoint
from tests.test_reliability import SCRIPTS, flags, module


def resume(script: str, checkpoint: dict | None, tmp_path, monkeypatch, capsys) -> str:
    """--resume --run-name old with `checkpoint` as runs/old's newest (iteration 2): the one error line."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "old" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None:
        write_checkpoint(checkpoint, folder / "iter_000002.safetensors")
    return refuse(module(script), [*flags(script, 3), "--resume", "--run-name", "old"], monkeypatch, capsys)


def evaluate(script: str, checkpoint: dict, tmp_path, monkeypatch, capsys) -> str:
    """--eval-checkpoint of `checkpoint` written as tmp_path/model.safetensors: the one error line."""
    monkeypatch.chdir(tmp_path)
    path = write_checkpoint(checkpoint, tmp_path / "model.safetensors")
    return refuse(module(script), ["--eval-checkpoint", str(path), "--eval-episodes", "1"], monkeypatch, capsys)


def changed(checkpoint: dict, **changes) -> dict:
    """A copy of `checkpoint` with header entries replaced (None: removed)."""
    copy = {key: value for key, value in checkpoint.items() if changes.get(key, 0) is not None}
    return {**copy, **{key: value for key, value in changes.items() if value is not None}}


def with_tensors(checkpoint: dict, **tensors: torch.Tensor | None) -> dict:
    """A copy of `checkpoint` with the named tensors replaced or added, or (None) removed."""
    found = dict(checkpoint["tensors"])
    for name, tensor in tensors.items():
        found.pop(name, None) if tensor is None else found.update({name: tensor})
    return {**checkpoint, "tensors": found}


def first_weights(checkpoint: dict) -> tuple[str, torch.Tensor]:
    return next((name, value) for name, value in checkpoint["tensors"].items() if name.startswith("model."))


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"env_id": None}, "holds nothing as its 'env_id', where ddrl writes a str"),
        ({"iteration": "2"}, "holds str as its 'iteration', where ddrl writes an int"),
        ({"rng": None}, "holds no random streams: it is damaged"),
        ({"kind": "model"}, "is a model file, not a training checkpoint"),
        ({"env_id": "Hopper-v5"}, "trains 'Hopper-v5', not --env-id"),
        ({"world_size": 4}, "was written by 4 ranks, not 1"),
        ({"rng": []}, "its random streams of rank 0 do not fit this run"),
        ({"version": 7}, "holds a header of ddrl's format version 7, not 1"),
        ({"optimizers": None}, "holds no optimizer states"),
    ],
    ids=["no-env", "iteration-str", "no-rng", "model-file", "other-env", "other-world", "rng-empty", "v7", "no-opt"],
)
def test_a_training_checkpoint_with_a_header_that_does_not_fit_is_one_line(
    script, changes, fault, saved, tmp_path, monkeypatch, capsys
):
    message = resume(script, changed(saved(script)[0], **changes), tmp_path, monkeypatch, capsys)
    assert message.startswith(f"{script}: error: runs/old/checkpoints/iter_000002.safetensors") and fault in message


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"env_id": None}, "holds nothing as its 'env_id', where ddrl writes a str"),
        ({"args": [1, 2]}, "holds list as its 'args', where ddrl writes a dict"),
        ({"format": "other"}, "holds a header of ddrl's format version"),
    ],
    ids=["no-env", "args-list", "other-format"],
)
def test_a_model_file_with_a_header_that_does_not_fit_is_one_line(
    script, changes, fault, saved, tmp_path, monkeypatch, capsys
):
    message = evaluate(script, changed(saved(script)[1], **changes), tmp_path, monkeypatch, capsys)
    assert message.startswith(f"{script}: error: {tmp_path / 'model.safetensors'}") and fault in message


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("how", ["resume", "evaluate"])
@pytest.mark.parametrize("fault", ["renamed", "reshaped", "retyped", "non-finite"])
def test_weights_that_do_not_fit_the_agent_name_the_file_the_writer_and_the_first_tensors(
    script, how, fault, saved, tmp_path, monkeypatch, capsys
):
    checkpoint = saved(script)[0 if how == "resume" else 1]
    name, value = first_weights(checkpoint)
    short = name.removeprefix("model.")
    if fault == "renamed":
        checkpoint = with_tensors(checkpoint, **{name: None, name + "_old": value})
        expected = [f"{short} missing", f"{short}_old unknown"]
    elif fault == "reshaped":
        checkpoint = with_tensors(checkpoint, **{name: torch.zeros(value.shape[0] + 1, *value.shape[1:])})
        expected = [f"{short} ({value.shape[0] + 1},"]
    elif fault == "retyped":
        checkpoint = with_tensors(checkpoint, **{name: value.to(torch.int32)})
        expected = [f"{short} I32, not F32"]
    else:
        checkpoint = with_tensors(checkpoint, **{name: torch.full_like(value, float("nan"))})
        expected = [f"its weights model.{short} are not finite"]
    if how == "resume":
        message = resume(script, checkpoint, tmp_path, monkeypatch, capsys)
    else:
        message = evaluate(script, checkpoint, tmp_path, monkeypatch, capsys)
    assert ".safetensors" in message and all(part in message for part in expected), message
    if fault != "non-finite":
        assert f"written by {script} (" in message and "its weights do not fit this Agent" in message


def test_another_scripts_file_names_its_writer_and_what_does_not_fit(saved, tmp_path, monkeypatch, capsys):
    """VPG's model file handed to continuous PPO's evaluation (both play Box envs of MuJoCo's kind)."""
    vpg = changed(saved("vpg_mpi.py")[1], env_id="Hopper-v5")
    message = evaluate("ppo_continuous_mpi.py", vpg, tmp_path, monkeypatch, capsys)
    assert "written by vpg_mpi.py (Vanilla policy gradient (VPG) with GAE-lambda" in message
    assert "its weights do not fit this Agent (actor_logstd missing, critic.0.weight (64, 4), not (64, 11)" in message


# --- a researcher's copy and the original's files ---------------------------------------------------------------

ADAMW = (
    "optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)",
    "optimizer = torch.optim.AdamW(agent.parameters(), lr=args.learning_rate, eps=1e-5, weight_decay=0.01)",
)
RMSPROP = (ADAMW[0], "optimizer = torch.optim.RMSprop(agent.parameters(), lr=args.learning_rate)")


def copy_of(script: str, folder: Path, name: str, *edits: tuple[str, str]) -> Path:
    source = (ROOT / script).read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (folder / name).write_text(source)
    return folder / name


def test_a_copy_with_another_optimizer_resumes_the_originals_checkpoint_with_the_command_lines_options(tmp_path):
    """cp ppo_continuous_mpi.py ppo_adamw.py, Adam made AdamW with weight decay: it resumes the original's run (Adam's
    per-parameter state fits AdamW's), says whose file it is and which options are now the command line's, and
    trains on with weight decay 0.01, where loading Adam's options would have left it 0."""
    continuous = "ppo_continuous_mpi.py"
    train_ranks(continuous, flags(continuous, 2, "--run-name", "run", "--checkpoint-every", "1"), tmp_path, nprocs=1)
    copy = copy_of(continuous, tmp_path, "ppo_adamw.py", ADAMW)
    resume_flags = flags(continuous, 3, "--run-name", "run", "--resume", "--checkpoint-every", "1")
    result = run_command([sys.executable, str(copy), *resume_flags], tmp_path)
    assert_ok(result)
    written_by = "runs/run/checkpoints/iter_000004.safetensors was written by ppo_continuous_mpi.py (PPO for"
    assert written_by in result.stdout and "its weights fit this ppo_adamw.py" in result.stdout  # 4 of one rank
    [options] = [line for line in result.stdout.splitlines() if "state loads into this run's" in line]
    assert "'optimizer' state loads into this run's Adam -> AdamW" in options and "weight_decay 0 -> 0.01" in options
    final = read_checkpoint(tmp_path / "runs/run/checkpoints/iter_000006.safetensors")
    [group] = final["optimizers"]["optimizer"]["param_groups"]
    assert final["script"] == "ppo_adamw.py" and final["optimizers"]["optimizer"]["type"] == "AdamW"
    assert group["weight_decay"] == 0.01 and group["decoupled_weight_decay"] is True


def test_a_copy_whose_optimizer_keeps_other_state_is_refused_in_one_line(saved, tmp_path):
    continuous = "ppo_continuous_mpi.py"
    write_checkpoint(saved(continuous)[0], tmp_path / "runs/old/checkpoints/iter_000002.safetensors")
    copy = copy_of(continuous, tmp_path, "ppo_rmsprop.py", RMSPROP)
    result = run_command([sys.executable, str(copy), *flags(continuous, 3, "--run-name", "old", "--resume")], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert line.startswith("ppo_rmsprop.py: error: runs/old/checkpoints/iter_000002.safetensors, written by ppo_cont")
    assert "its 'optimizer' holds Adam's state (0.square_avg missing" in line and "fit this run's RMSprop" in line
    assert "resume with the optimizer that wrote it, or start a new run" in line


def test_a_copy_with_one_more_hidden_layer_is_refused_naming_the_layer(saved, tmp_path):
    vpg = "vpg_mpi.py"
    path = write_checkpoint(saved(vpg)[1], tmp_path / "model.safetensors")
    deeper = ("self.actor = mlp(obs_dim, hidden_sizes,", "self.actor = mlp(obs_dim, (*hidden_sizes, 32),")
    copy = copy_of(vpg, tmp_path, "vpg_deeper.py", deeper)
    result = run_command([sys.executable, str(copy), "--eval-checkpoint", str(path), "--eval-episodes", "1"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"vpg_deeper.py: error: {path}, written by vpg_mpi.py (" in result.stderr
    assert "its weights do not fit this Agent (actor.4.weight (2, 64), not (32, 64)" in result.stderr


def test_a_copy_evaluates_the_originals_model_saying_whose_it_is(saved, tmp_path):
    path = write_checkpoint(saved("vpg_mpi.py")[1], tmp_path / "model.safetensors")
    copy = shutil.copy(ROOT / "vpg_mpi.py", tmp_path / "my_vpg.py")
    result = run_command([sys.executable, str(copy), "--eval-checkpoint", str(path), "--eval-episodes", "1"], tmp_path)
    assert_ok(result)
    assert f"{path} was written by vpg_mpi.py (" in result.stdout and "its weights fit this my_vpg.py" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("eval: episodes=1 return_mean=")


# --- a round trip restores every tensor and random stream ----------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_checkpoint_round_trip_restores_every_tensor_and_random_stream_bit_for_bit(script, saved, tmp_path):
    """What save() wrote of a trained Agent, its optimizers and this process's streams, loaded into fresh ones after
    the streams moved on: every weight, buffer, optimizer tensor and the next draws of Python, numpy and torch."""
    header = saved(script)[0]
    path = write_checkpoint(header, tmp_path / "iter_000002.safetensors")
    algorithm = module(script)
    args = algorithm.Args()
    agent = fresh_agent(script, algorithm, header)
    optimizers = fresh_optimizers(script, agent, args)
    checkpoints.load_training_state(str(path), header, 0, {"model": agent, **optimizers})
    draws = (random.random(), np.random.random(), torch.rand(()).item())
    for name, value in agent.state_dict().items():
        assert torch.equal(value, header["tensors"][f"model.{name}"]), name
    for entry, optimizer in optimizers.items():
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                assert torch.equal(value.cpu(), header["tensors"][f"{entry}.state.{index}.{key}"].cpu()), (entry, key)
    checkpoints.load_random_streams(str(path), header, 0)
    assert (random.random(), np.random.random(), torch.rand(()).item()) == draws  # the same streams, from there


def fresh_agent(script: str, algorithm, header: dict) -> torch.nn.Module:
    import gymnasium as gym

    env = gym.make(header["env_id"])
    if script == "vpg_mpi.py":
        return algorithm.Agent(env.observation_space.shape[0], env.action_space, tuple(header["args"]["hidden_sizes"]))
    if script == "ppo_continuous_mpi.py":
        return algorithm.Agent(env.observation_space.shape[0], env.action_space.shape[0])
    return algorithm.Agent(int(env.action_space.n))


def fresh_optimizers(script: str, agent: torch.nn.Module, args) -> dict[str, torch.optim.Optimizer]:
    if script == "vpg_mpi.py":
        return {
            "pi_optimizer": torch.optim.Adam(agent.policy_parameters(), lr=args.pi_lr),
            "vf_optimizer": torch.optim.Adam(agent.critic.parameters(), lr=args.vf_lr),
        }
    return {"optimizer": torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)}


def test_save_writes_every_ranks_streams_through_the_store_and_resume_reads_this_ranks(tmp_path, monkeypatch):
    """checkpoints.save on a world of one: the file holds this rank's Python, numpy and torch streams as they were."""
    monkeypatch.chdir(tmp_path)
    algorithm = module("vpg_mpi.py")
    args = dataclasses.replace(algorithm.Args(), env_id="CartPole-v1")
    run = launching.Run(args, str(ROOT / "vpg_mpi.py"), "epoch", 0, 1, 0, 1, name="run")
    run.store = torch.distributed.HashStore()
    run.writer = type("Writer", (), {"flush": lambda self: None})()
    agent = fresh_agent("vpg_mpi.py", algorithm, {"env_id": "CartPole-v1", "args": {"hidden_sizes": [8]}})
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    checkpoints.save(run, 1, 100, model=agent, **fresh_optimizers("vpg_mpi.py", agent, args))
    draws = (random.random(), np.random.random(), torch.rand(()).item())
    header = read_checkpoint(tmp_path / "runs/run/checkpoints/iter_000001.safetensors")
    assert header["iteration"] == 1 and header["global_step"] == 100 and len(header["rng"]) == 1
    checkpoints.load_random_streams(str(tmp_path / "runs/run/checkpoints/iter_000001.safetensors"), header, 0)
    assert (random.random(), np.random.random(), torch.rand(()).item()) == draws


@pytest.mark.parametrize("how", ["resume", "evaluate"])
def test_a_file_whose_header_length_begins_with_a_pickles_first_byte_is_read(how, saved, tmp_path):
    """A header of 384, 640, ... bytes puts 0x80 first in the file, as a pickle begins: the file is still a
    checkpoint (the length fits the file), so it resumes and evaluates."""
    script = "vpg_mpi.py"
    checkpoint = saved(script)[0 if how == "resume" else 1]
    path = tmp_path / ("runs/old/checkpoints/iter_000002.safetensors" if how == "resume" else "model.safetensors")
    for padding in range(256):  # a longer header entry, byte by byte, until the length's lowest byte is 0x80
        write_checkpoint({**checkpoint, "padding": "x" * padding}, path)
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80 and checkpoints.file_problem(str(path)) is None
    argv = [*flags(script, 4), "--resume", "--run-name", "old"]  # two iterations on from the checkpoint's second
    argv = argv if how == "resume" else ["--eval-checkpoint", str(path), "--eval-episodes", "1"]
    result = run_command([sys.executable, str(ROOT / script), *argv], tmp_path)
    assert_ok(result)
    said = "resuming from runs/old/checkpoints/iter_000002" if how == "resume" else "eval: episodes=1"
    assert said in result.stdout
    if how == "resume":
        assert f"done: {4 * SCRIPTS[script][1]} env steps" in result.stdout
