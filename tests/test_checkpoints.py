"""Checkpoints, for every script: they hold only what torch's weights-only loader reads (tensors, numbers, strings,
lists, dicts), so loading one runs no code; one that does not fit ends in one line naming the file and the fault,
whether it is resumed (--resume, elastic restarts) or evaluated (--eval-checkpoint)."""

import os

import numpy as np
import pytest
import torch

from tests.helpers import refuse
from tests.test_reliability import SCRIPTS, flags, module


class Mark:
    """A pickled call of os.mkdir(path): a file that carries code, which leaves a folder behind if it ever runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def resume(script: str, checkpoint: dict | None, tmp_path, monkeypatch, capsys, write=torch.save) -> str:
    """--resume --run-name old with `checkpoint` as runs/old's newest (iteration 2): the one error line."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "old" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    if checkpoint is not None:
        write(checkpoint, folder / "iter_000002.pt")
    return refuse(module(script), [*flags(script, 3), "--resume", "--run-name", "old"], monkeypatch, capsys)


def evaluate(script: str, path, tmp_path, monkeypatch, capsys) -> str:
    """--eval-checkpoint `path`: the one error line."""
    monkeypatch.chdir(tmp_path)
    return refuse(module(script), ["--eval-checkpoint", str(path), "--eval-episodes", "1"], monkeypatch, capsys)


def changed(checkpoint: dict, **changes) -> dict:
    """A copy of `checkpoint` with entries replaced (None: removed)."""
    copy = {key: value for key, value in checkpoint.items() if changes.get(key, 0) is not None}
    return {**copy, **{key: value for key, value in changes.items() if value is not None}}


def first_weights(checkpoint: dict) -> tuple[str, torch.Tensor]:
    return next((key, value) for key, value in checkpoint["model"].items() if value.is_floating_point())


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("how", ["resume", "evaluate"])
def test_a_checkpoint_that_carries_code_is_refused_and_none_of_it_runs(
    script, how, saved, tmp_path, monkeypatch, capsys
):
    mark = tmp_path / "mark"
    training, model = saved(script)
    if how == "resume":
        message = resume(
            script, changed(training, model={**training["model"], "x": Mark(mark)}), tmp_path, monkeypatch, capsys
        )
    else:
        torch.save(changed(model, args={**model["args"], "x": Mark(mark)}), tmp_path / "model.pt")
        message = evaluate(script, tmp_path / "model.pt", tmp_path, monkeypatch, capsys)
    assert "carries code or objects that no checkpoint holds" in message and ".pt" in message
    assert not mark.exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_training_checkpoint_of_an_earlier_version_says_so(script, saved, tmp_path, monkeypatch, capsys):
    """Earlier versions kept numpy's random state as numpy's own tuple, which only pickle loads."""
    training, _ = saved(script)
    rng = [{**training["rng"][0], "numpy": np.random.get_state()}]
    message = resume(script, changed(training, rng=rng), tmp_path, monkeypatch, capsys)
    assert f"runs/old/checkpoints/iter_000002.pt was written by an earlier version of {script}" in message
    assert "resume or evaluate it with the version that wrote it" in message


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"env_id": None}, "holds nothing as 'env_id' where"),
        ({"iteration": "2"}, "holds str as 'iteration' where"),
        ({"rng": None}, "holds nothing as 'rng' where"),
        ({"script": "other.py"}, "is not a training checkpoint of"),
        ({"env_id": "Hopper-v5"}, "trains Hopper-v5, not --env-id"),
        ({"world_size": 4}, "was written by 4 ranks, not 1"),
        ({"rng": []}, "its 'rng' does not fit this run"),
    ],
    ids=["no-env", "iteration-str", "no-rng", "other-script", "other-env", "other-world", "rng-empty"],
)
def test_a_training_checkpoint_with_an_entry_that_does_not_fit_is_one_line(
    script, changes, fault, saved, tmp_path, monkeypatch, capsys
):
    message = resume(script, changed(saved(script)[0], **changes), tmp_path, monkeypatch, capsys)
    assert message.startswith(f"{script}: error: runs/old/checkpoints/iter_000002.pt") and fault in message


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    ("changes", "fault"),
    [
        ({"env_id": None}, "holds nothing as 'env_id' where"),
        ({"model": [1, 2]}, "holds list as 'model' where"),
        ({"script": "other.py"}, "is not a model of"),
    ],
    ids=["no-env", "model-list", "other-script"],
)
def test_a_model_with_an_entry_that_does_not_fit_is_one_line(
    script, changes, fault, saved, tmp_path, monkeypatch, capsys
):
    torch.save(changed(saved(script)[1], **changes), tmp_path / "model.pt")
    message = evaluate(script, tmp_path / "model.pt", tmp_path, monkeypatch, capsys)
    assert message.startswith(f"{script}: error: {tmp_path / 'model.pt'}") and fault in message


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("how", ["resume", "evaluate"])
@pytest.mark.parametrize("fault", ["renamed", "reshaped", "non-finite"])
def test_weights_that_do_not_fit_the_agent_name_the_file_and_the_first_keys(
    script, how, fault, saved, tmp_path, monkeypatch, capsys
):
    checkpoint = saved(script)[0 if how == "resume" else 1]
    key, value = first_weights(checkpoint)
    weights = dict(checkpoint["model"])
    if fault == "renamed":
        weights[key + "_old"] = weights.pop(key)
        expected = [f"{key} missing", f"{key}_old unknown"]
    elif fault == "reshaped":
        weights[key] = torch.zeros(value.shape[0] + 1, *value.shape[1:])
        expected = [f"{key} ({value.shape[0] + 1},"]
    else:
        weights[key] = torch.full_like(value, float("nan"))
        expected = [f"its weights {key} are not finite"]
    if how == "resume":
        message = resume(script, changed(checkpoint, model=weights), tmp_path, monkeypatch, capsys)
    else:
        torch.save(changed(checkpoint, model=weights), tmp_path / "model.pt")
        message = evaluate(script, tmp_path / "model.pt", tmp_path, monkeypatch, capsys)
    assert ".pt: its weights" in message and all(part in message for part in expected), message


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("how", ["resume", "evaluate"])
@pytest.mark.parametrize("fault", ["truncated", "folder"])
def test_a_truncated_file_or_a_folder_is_one_line(script, how, fault, saved, tmp_path, monkeypatch, capsys):
    checkpoint = saved(script)[0 if how == "resume" else 1]
    path = tmp_path / ("runs/old/checkpoints/iter_000002.pt" if how == "resume" else "model.pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fault == "folder":
        path.mkdir()
    else:
        torch.save(checkpoint, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    if how == "resume":
        message = resume(script, None, tmp_path, monkeypatch, capsys)
    else:
        message = evaluate(script, path, tmp_path, monkeypatch, capsys)
    assert ("is a folder" if fault == "folder" else "is truncated or not a checkpoint") in message
    assert str(path.relative_to(tmp_path) if how == "resume" else path) in message
