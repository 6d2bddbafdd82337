"""Checkpoints: one safetensors file of tensors and a JSON header, so reading one runs no code. A file is recognised by
what it holds: a copy of a script loads the original's where its Agent and optimizer fit (and says whose it is),
keeping the command line's optimizer options; anything that does not fit, resumed or evaluated, ends in one line naming
the file, who wrote it and the misfit. A round trip restores every tensor and random stream. The reading and writing
are ddrl's, the same for every script: they are exercised through VPG's files, and continuous PPO's where its Agent
(statistics in buffers) or its optimizer is the point."""

import random
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_continuous_mpi
import vpg_mpi
from ddrl import checkpoint_files, checkpoints, compiled_step, launching, run_folders
from ddrl.run import Run
from tests.helpers import (
    ROOT,
    assert_ok,
    progress_lines,
    read_checkpoint,
    refuse,
    run_python,
    tiny_flags,
    train_ranks,
    world_batch,
    write_checkpoint,
)

VPG = "vpg_mpi.py"
CONTINUOUS = "ppo_continuous_mpi.py"
RESUMED = "runs/old/checkpoints/iter_000002.safetensors"


def resume(checkpoint: dict, tmp_path, monkeypatch, capsys) -> str:
    """VPG's --resume --run-name old with `checkpoint` as runs/old's newest (iteration 2): the one error line."""
    monkeypatch.chdir(tmp_path)
    write_checkpoint(checkpoint, tmp_path / RESUMED)
    return refuse(vpg_mpi, tiny_flags(VPG, 3, "--resume", "--run-name", "old"), monkeypatch, capsys)


def evaluate(module, checkpoint: dict, tmp_path, monkeypatch, capsys) -> str:
    """--eval-checkpoint of `checkpoint` written as tmp_path/model.safetensors: the one error line."""
    monkeypatch.chdir(tmp_path)
    path = write_checkpoint(checkpoint, tmp_path / "model.safetensors")
    return refuse(module, ["--eval-checkpoint", str(path), "--eval-episodes", "1"], monkeypatch, capsys)


def changed(checkpoint: dict, **changes) -> dict:
    """A copy of `checkpoint` with header entries replaced (None: removed)."""
    copy = {key: value for key, value in checkpoint.items() if changes.get(key, 0) is not None}
    return {**copy, **{key: value for key, value in changes.items() if value is not None}}


def with_tensors(checkpoint: dict, **tensors: torch.Tensor | None) -> dict:
    """A copy of `checkpoint` with the named tensors replaced or added, or (None) removed."""
    found = dict(checkpoint["tensors"])
    for name, tensor in tensors.items():
        if tensor is None:
            found.pop(name, None)
        else:
            found[name] = tensor
    return {**checkpoint, "tensors": found}


def without_random_streams(checkpoint: dict) -> dict:
    return with_tensors(checkpoint, **{name: None for name in checkpoint["tensors"] if name.startswith("rng.")})


def numpy_key_out_of_range(checkpoint: dict) -> dict:
    return with_tensors(checkpoint, **{"rng.numpy": checkpoint["tensors"]["rng.numpy"] - 2**33})


TRAINING_HEADERS = [
    ({"env_id": None}, "holds nothing as its 'env_id', where ddrl writes a str"),
    ({"iteration": "2"}, "holds '2' as its 'iteration', where ddrl writes an int in [0, 9007199254740992]"),
    (without_random_streams, ": its random streams do not fit its 1 ranks (rng.python missing,"),
    ({"kind": "model"}, "is a 'model' file, not a training checkpoint"),
    ({"env_id": "Hopper-v5"}, "trains 'Hopper-v5', not --env-id CartPole-v1; pass that --env-id"),
    ({"world_size": 4}, ": its random streams do not fit its 4 ranks (rng.python (1, 625), not (4, 625),"),
    (numpy_key_out_of_range, "its random streams of rank 0 do not fit this run (numpy's key holds numbers outside"),
    ({"version": 7}, "holds a header of ddrl's format version 7, not 2: use the ddrl that wrote it"),
    ({"optimizers": None}, "holds no optimizer states: it is damaged"),
]


@pytest.mark.parametrize(
    ("changes", "fault"),
    TRAINING_HEADERS,
    ids=["no-env", "iteration-str", "no-rng", "model-file", "other-env", "other-world", "rng-numpy", "v7", "no-opt"],
)
def test_a_training_checkpoint_that_does_not_fit_is_one_line(changes, fault, saved, tmp_path, monkeypatch, capsys):
    training = saved(VPG)[0]
    checkpoint = changes(training) if callable(changes) else changed(training, **changes)
    message = resume(checkpoint, tmp_path, monkeypatch, capsys)
    assert message.startswith(f"{VPG}: error: {RESUMED}") and fault in message, message


@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"env_id": None}, "holds nothing as its 'env_id', where ddrl writes a str"),
        ({"args": [1, 2]}, "holds list as its 'args', where ddrl writes a dict"),
        ({"format": "other"}, "holds a header of format 'other', not ddrl's"),
    ],
    ids=["no-env", "args-list", "other-format"],
)
def test_a_model_file_with_a_header_that_does_not_fit_is_one_line(changes, fault, saved, tmp_path, monkeypatch, capsys):
    message = evaluate(vpg_mpi, changed(saved(VPG)[1], **changes), tmp_path, monkeypatch, capsys)
    assert message.startswith(f"{VPG}: error: {tmp_path / 'model.safetensors'}") and fault in message, message


@pytest.mark.parametrize("how", ["resume", "evaluate"])
@pytest.mark.parametrize("fault", ["renamed", "reshaped", "retyped", "non-finite"])
def test_weights_that_do_not_fit_the_agent_name_the_file_the_writer_and_the_first_tensors(
    how, fault, saved, tmp_path, monkeypatch, capsys
):
    checkpoint = saved(VPG)[0 if how == "resume" else 1]
    name = "model.actor.0.weight"
    value = checkpoint["tensors"][name]
    if fault == "renamed":
        checkpoint = with_tensors(checkpoint, **{name: None, name + "_old": value})
        expected = ["actor.0.weight missing", "'actor.0.weight_old' unknown"]
    elif fault == "reshaped":
        checkpoint = with_tensors(checkpoint, **{name: torch.zeros(value.shape[0] + 1, *value.shape[1:])})
        expected = [f"actor.0.weight ({value.shape[0] + 1}, {value.shape[1]}), not {tuple(value.shape)}"]
    elif fault == "retyped":
        checkpoint = with_tensors(checkpoint, **{name: value.to(torch.int32)})
        expected = ["actor.0.weight 'I32', not F32"]
    else:
        checkpoint = with_tensors(checkpoint, **{name: torch.full_like(value, float("nan"))})
        expected = [f"its '{name}' hold(s) NaN or infinity; use a checkpoint from before"]
    if how == "resume":
        message = resume(checkpoint, tmp_path, monkeypatch, capsys)
    else:
        message = evaluate(vpg_mpi, checkpoint, tmp_path, monkeypatch, capsys)
    assert ".safetensors" in message and all(part in message for part in expected), message
    if fault != "non-finite":
        assert f"written by '{VPG}' ('Vanilla policy gradient" in message, message
        assert "its weights do not fit this Agent" in message, message


def test_another_scripts_file_names_its_writer_and_what_does_not_fit(saved, tmp_path, monkeypatch, capsys):
    """VPG's model file handed to continuous PPO's evaluation (both play Box envs of MuJoCo's kind)."""
    model = saved(VPG)[1]
    vpg = changed(model, env_id="Hopper-v5", args={**model["args"], "env_id": "Hopper-v5"})
    message = evaluate(ppo_continuous_mpi, vpg, tmp_path, monkeypatch, capsys)
    assert f"written by '{VPG}' ('Vanilla policy gradient (VPG) with GAE-lambda" in message, message
    assert "its weights do not fit this Agent (actor_logstd missing, obs_rms.mean missing" in message, message


# --- a researcher's copy and the original's files ---------------------------------------------------------------

ADAMW = (
    "optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)",
    "optimizer = optim.AdamW(agent.parameters(), lr=args.learning_rate, eps=1e-5, weight_decay=0.01)",
)
RMSPROP = (
    "        optimizer = optim.Adam(\n            [\n",
    "        optimizer = optim.RMSprop(\n            [\n",
)  # VPG's two groups


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
    run_flags = tiny_flags(CONTINUOUS, 2, "--run-name", "run", "--checkpoint-every", "1")
    train_ranks(CONTINUOUS, run_flags, tmp_path, nprocs=1)
    copy = copy_of(CONTINUOUS, tmp_path, "ppo_adamw.py", ADAMW)
    result = run_python(
        copy, tiny_flags(CONTINUOUS, 4, "--run-name", "run", "--resume", "--checkpoint-every", "1"), tmp_path
    )
    assert_ok(result)
    written_by = f"runs/run/checkpoints/iter_000002.safetensors was written by '{CONTINUOUS}' ('PPO for continuous"
    assert written_by in result.stdout and "its weights fit this ppo_adamw.py" in result.stdout, result.stdout
    [options] = [line for line in result.stdout.splitlines() if "loads into this run's" in line]
    assert "its 'optimizer' state, a 'Adam''s, loads into this run's AdamW" in options, options
    assert "weight_decay 0 -> 0.01" in options, options
    assert progress_lines(result.stdout) == [3, 4]
    final = read_checkpoint(tmp_path / "runs/run/checkpoints/iter_000004.safetensors")
    [group] = final["optimizers"]["optimizer"]["param_groups"]
    assert final["script"] == "ppo_adamw.py" and final["optimizers"]["optimizer"]["type"] == "AdamW"
    assert group["weight_decay"] == 0.01 and group["decoupled_weight_decay"] is True


def test_a_copy_whose_optimizer_keeps_other_state_is_refused_in_one_line(saved, tmp_path):
    """VPG's one Adam (its policy and value groups) made RMSprop in a copy: Adam's state fits no RMSprop."""
    write_checkpoint(saved(VPG)[0], tmp_path / RESUMED)
    copy = copy_of(VPG, tmp_path, "vpg_rmsprop.py", RMSPROP)
    result = run_python(copy, tiny_flags(VPG, 3, "--run-name", "old", "--resume"), tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"vpg_rmsprop.py: error: {RESUMED}, written by '{VPG}' (")
    assert (
        "its 'optimizer' holds the state of a 'Adam' (0.square_avg missing" in line and "fit this run's RMSprop" in line
    )
    assert "resume with the optimizer that wrote it, or start a new run" in line


def test_a_copy_with_one_more_hidden_layer_is_refused_naming_the_layer(saved, tmp_path):
    path = write_checkpoint(saved(VPG)[1], tmp_path / "model.safetensors")
    deeper = ("self.actor = mlp(obs_dim, hidden_sizes,", "self.actor = mlp(obs_dim, (*hidden_sizes, 32),")
    copy = copy_of(VPG, tmp_path, "vpg_deeper.py", deeper)
    result = run_python(copy, ["--eval-checkpoint", str(path), "--eval-episodes", "1"], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith(f"vpg_deeper.py: error: {path}, written by '{VPG}' (")
    assert "its weights do not fit this Agent (actor.4.weight (2, 64), not (32, 64)" in result.stderr


def test_a_copy_evaluates_the_originals_model_saying_whose_it_is(saved, tmp_path):
    path = write_checkpoint(saved(VPG)[1], tmp_path / "model.safetensors")
    copy = shutil.copy(ROOT / VPG, tmp_path / "my_vpg.py")
    result = run_python(Path(copy), ["--eval-checkpoint", str(path), "--eval-episodes", "1"], tmp_path)
    assert_ok(result)
    assert f"{path} was written by '{VPG}' (" in result.stdout and "its weights fit this my_vpg.py" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("eval: episodes=1 return_mean=")


# --- a round trip restores every tensor and random stream -----------------------------------------------------------


def trained_agent(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Continuous PPO's Agent and Adam as main builds them, moved on from their start: two Adam steps, and
    observation statistics merged from data (8 x `seed` observations)."""
    args = ppo_continuous_mpi.Args(env_id="InvertedPendulum-v5")
    envs = gym.vector.SyncVectorEnv([ppo_continuous_mpi.make_env(args)])
    torch.manual_seed(seed)
    agent = ppo_continuous_mpi.Agent(envs)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5, fused=True)
    obs = torch.randn(8 * seed, 4, dtype=torch.float64)
    for statistics, data in ((agent.obs_rms, obs), (agent.return_rms, obs[:, 0])):
        mean = data.mean(0)
        statistics.update(torch.tensor(8.0 * seed, dtype=torch.float64), mean, ((data - mean) ** 2).sum(0))
    for _ in range(2):
        _, log_prob, _, value = agent.get_action_and_value(obs.float())
        loss = (log_prob + value.squeeze(1)).sum()  # every parameter has a gradient
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return agent, optimizer


def draws() -> tuple:
    """The next numbers of every random stream a run uses, each generator's cached gaussian first."""
    return (random.gauss(0, 1), random.random(), np.random.standard_normal(), np.random.random(), torch.rand(3))


@pytest.mark.quick
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-step"])
def test_a_checkpoint_round_trip_restores_every_tensor_and_random_stream_bit_for_bit(compiled, tmp_path, monkeypatch):
    """What Run.checkpoint writes of a trained Agent (weights, statistics), its Adam and this rank's streams (each
    with a cached gaussian), loaded by Run.resume's loader into a fresh Agent and Adam after the streams moved on:
    every parameter, buffer and optimizer tensor, and the next draws of Python, numpy and torch, bit for bit. Also
    where --compile's step holds the parameters and Adam's moments as views of flat tensors."""
    monkeypatch.chdir(tmp_path)
    agent, optimizer = trained_agent(seed=1)
    args = ppo_continuous_mpi.Args(env_id="InvertedPendulum-v5")
    if compiled:
        compiled_step.CompiledStep(agent, optimizer, ppo_continuous_mpi.minibatch_loss, None, None, args)
        shared = {p.untyped_storage().data_ptr() for p in agent.parameters()}
        assert len(shared) == 1  # every parameter a view of the step's one flat tensor
    world = launching.World(store=torch.distributed.HashStore())
    run = Run(args, str(ROOT / CONTINUOUS), world, folder=run_folders.RunFolder("run"))
    (tmp_path / "runs/run").mkdir(parents=True)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    random.gauss(0, 1)  # each leaves a gaussian cached, which the streams must carry
    np.random.standard_normal()
    run.checkpoint(2, 128, agent=agent, optimizer=optimizer)
    expected = draws()
    path = tmp_path / "runs/run/checkpoints/iter_000002.safetensors"
    header = {**read_checkpoint(path), "path": str(path)}
    assert header["iteration"] == 2 and header["global_step"] == 128 and header["world_size"] == 1
    fresh_agent, fresh_optimizer = trained_agent(seed=2)
    for name, value in fresh_agent.state_dict().items():
        assert not torch.equal(value, agent.state_dict()[name]), name  # every tensor the load must restore differs
    checkpoints.load_training_state(str(path), header, 0, {"agent": fresh_agent, "optimizer": fresh_optimizer})
    restored = draws()
    assert restored[:4] == expected[:4] and torch.equal(restored[4], expected[4]), (restored, expected)
    for name, value in agent.state_dict().items():
        assert torch.equal(fresh_agent.state_dict()[name], value), name
    for (name, value), (_, fresh) in zip(agent.named_buffers(), fresh_agent.named_buffers(), strict=True):
        assert torch.equal(fresh, value), name  # the normalising copies too, which the file does not hold
    saved_state = optimizer.state_dict()
    loaded_state = fresh_optimizer.state_dict()
    assert loaded_state["param_groups"] == saved_state["param_groups"]
    for index, state in saved_state["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded_state["state"][index][key], value), (index, key)


@pytest.mark.parametrize("how", ["resume", "evaluate"])
def test_a_file_whose_header_length_begins_with_a_pickles_first_byte_is_read(how, saved, tmp_path):
    """A header of 384, 640, ... bytes puts 0x80 first in the file, as a pickle begins: the file is still a
    checkpoint (the length fits the file), so it resumes and evaluates."""
    checkpoint = saved(VPG)[0 if how == "resume" else 1]
    path = tmp_path / (RESUMED if how == "resume" else "model.safetensors")
    for padding in range(256):  # a longer header entry, byte by byte, until the length's lowest byte is 0x80
        write_checkpoint({**checkpoint, "padding": "x" * padding}, path)
        if path.read_bytes()[0] == 0x80:
            break
    assert path.read_bytes()[0] == 0x80 and checkpoint_files.file_problem(str(path)) is None
    argv = tiny_flags(VPG, 4, "--resume", "--run-name", "old")  # two iterations on from the checkpoint's second
    argv = argv if how == "resume" else ["--eval-checkpoint", str(path), "--eval-episodes", "1"]
    result = run_python(ROOT / VPG, argv, tmp_path)
    assert_ok(result)
    said = f"resuming from {RESUMED}" if how == "resume" else "eval: episodes=1"
    assert said in result.stdout
    if how == "resume":
        assert progress_lines(result.stdout) == [3, 4] and f"done: {4 * world_batch(VPG)} env steps" in result.stdout
