"""`python -m ddrl.verify COPY` passes only what it ran and compared: a file that is no script is refused in one line
(exit code 2) in bounded time, a learning rate per rank fails in one line that names it, a worker killed by a signal
is named, and an edit that keeps the promise passes with a wide margin in float64."""

import re

import pytest

from tests.helpers import ROOT, edited_copy, verified, verify

VPG = (ROOT / "vpg_mpi.py").read_text()
NOT_SCRIPTS = {  # file name, its text, what the one line says, verify's extra flags
    "a README": ("README.md", (ROOT / "README.md").read_text(), "README.md is no Python script (a .py file)", []),
    "no .py suffix": ("vpg_mpi", VPG, "vpg_mpi is no Python script (a .py file)", []),
    "an empty file": ("empty.py", "", "empty.py defines no Args, main, update", []),
    "a syntax error": (
        "syntax.py",
        VPG.replace("def layer_init(", "def layer_init((", 1),
        "syntax.py does not compile: SyntaxError: ",
        [],
    ),
    "a missing import": (
        "missing.py",
        "import ddrl_no_such_module\n" + VPG,
        "importing missing.py needs the module 'ddrl_no_such_module', which is not installed",
        [],
    ),
    "sys.exit at import": ("exits.py", "import sys\n\nsys.exit(0)\n" + VPG, "exits.py exits when imported", []),
    "a loop at import": (
        "loops.py",
        "while True:\n    pass\n" + VPG,
        "loops.py did not finish importing within 3 s",
        ["--import-timeout", "3"],
    ),
}
PER_RANK_LR = [  # a sweep over the policy's learning rate inside one launch
    ('"lr": args.pi_lr}', '"lr": args.pi_lr * (1 + run.rank)}')
]
VPG_STATE_DEPENDENT_LOG_STD = [
    (
        "self.log_std = nn.Parameter(torch.full((num_outputs,), -0.5))",
        "self.log_std = layer_init(nn.Linear(obs_dim, num_outputs))",
    ),
    ("torch.exp(self.log_std)", "torch.exp(self.log_std(x))"),
]
FLOAT32_CRITIC = [  # an update that cannot run in float64: verify runs it in float32 and says so
    (
        "    def get_value(self, x: torch.Tensor) -> torch.Tensor:\n        return self.critic(x)\n",
        "    def get_value(self, x: torch.Tensor) -> torch.Tensor:\n        return self.critic(x.float())\n",
    )
]
RANK_1_KILLED = [
    (
        '    obs = batch["obs"]\n    returns = batch["returns"]\n',
        '    obs = batch["obs"]\n    returns = batch["returns"]\n'
        "    if collectives.rank_in(group) == 1:\n"
        "        import os\n        import signal\n\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n",
    )
]


@pytest.mark.parametrize("case", list(NOT_SCRIPTS))
def test_a_file_that_is_no_script_is_refused_in_one_line(case, tmp_path):
    """Nothing of it runs in verify's own process: an exit or a loop at import is refused as a syntax error is."""
    name, text, said, flags = NOT_SCRIPTS[case]
    (tmp_path / name).write_text(text)
    result = verify(tmp_path / name, *flags)
    assert result.returncode == 2 and result.stdout == "", (result.returncode, result.stdout)
    [line] = result.stderr.splitlines()
    assert line.startswith(f"verify: error: {said}"), line


def test_a_learning_rate_per_rank_fails_naming_it_and_that_one_launch_trains_one_model(tmp_path):
    """Each rank keeps the optimizer it built: a sweep inside one launch is not hidden by the reference's rates."""
    result = verify(edited_copy(tmp_path, "vpg_mpi.py", PER_RANK_LR))
    assert result.returncode == 1 and result.stdout == "", (result.returncode, result.stdout)
    [line] = result.stderr.splitlines()
    assert line.startswith(
        "verify: at two ranks (allreduce), iteration 1: rank 1's optimizer's lr (parameter group 0) is 0.0006, where "
        "the one-rank run's is 0.0003: "
    ), line
    assert "one launch trains one model, its gradients averaged" in line and "one launch per value" in line


def test_a_state_dependent_log_std_passes_with_a_wide_margin_in_float64(tmp_path):
    """The runs go in float64: float32 reordering, which took this copy to 6.5e-06 of a 1e-05 tolerance after one
    update, is gone; three iterations of Adam leave float64's rounding far below the tolerance still."""
    said = verified(edited_copy(tmp_path, "vpg_mpi.py", VPG_STATE_DEPENDENT_LOG_STD))
    found = re.search(r"within (\S+) in float64 \(largest difference (\S+)\)", said)
    assert found, said
    assert float(found[2]) < float(found[1]) / 50, said


def test_an_update_that_cannot_run_in_float64_is_compared_in_float32_saying_so(tmp_path):
    said = verified(edited_copy(tmp_path, "vpg_mpi.py", FLOAT32_CRITIC))
    assert "within 1e-05 in float32, as it does not run in float64 (RuntimeError: " in said


def test_a_worker_killed_by_a_signal_is_named_in_one_line(tmp_path):
    result = verify(edited_copy(tmp_path, "vpg_mpi.py", RANK_1_KILLED))
    assert result.returncode == 1 and result.stdout == "", (result.returncode, result.stdout)
    [line] = result.stderr.splitlines()
    assert line == (
        "verify: the two-rank run (allreduce) stopped before iteration 1 ended: rank 1 was killed by SIGKILL"
    )
