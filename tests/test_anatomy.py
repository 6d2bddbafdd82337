"""The three scripts read alike (docs/design.md, "Anatomy of a script"): the algorithm first, and one runtime block
at the bottom that is the same text in every script."""

import ast
import subprocess
import sys

import gymnasium.vector
import gymnasium.wrappers
import pytest
import torch.distributed
import torch.nn

from tests.helpers import ROOT

SCRIPTS = ("ppo_continuous_mpi.py", "ppo_atari_multigpu.py", "vpg_mpi.py")
RUNTIME_START = "# RUNTIME: "
RUNTIME_END = "# END OF RUNTIME"
# what a reader who knows CleanRL looks for, in this order, each piece before its first use; after `main`, what it
# names and what is not the algorithm (input checks, the batch table, evaluation)
ALGORITHM_ORDER = ("Args", "derive_batch_sizes", "make_env", "layer_init", "Agent", "compute_gae", "update", "main")
AFTER_MAIN = (
    "explained_variance",
    "check_rollout_policy",
    "check_args",
    "batch_table",
    "evaluate",
    "evaluate_checkpoint",
)
ALSO_IN_ORDER = {  # a script's own pieces, where its reader meets them
    "ppo_continuous_mpi.py": ("RunningMeanStd", "Agent", "update", "gather_to_learner", "update_one_learner", "main"),
    "vpg_mpi.py": ("update", "gather_to_learner", "update_one_learner", "main"),
    "ppo_atari_multigpu.py": ("Agent", "RolloutPolicy", "main", "Rollout", "check_rollout_policy"),
}


def runtime_block(script: str) -> str:
    """The text between the runtime markers (the banner lines included)."""
    lines = (ROOT / script).read_text().splitlines(keepends=True)
    [start] = [i for i, line in enumerate(lines) if line.startswith(RUNTIME_START)]
    [end] = [i for i, line in enumerate(lines) if line.startswith(RUNTIME_END)]
    return "".join(lines[start - 1 : end + 2])


def test_the_runtime_block_is_the_same_text_in_every_script():
    blocks = {script: runtime_block(script) for script in SCRIPTS}
    reference = blocks[SCRIPTS[0]]
    assert "class Run(" in reference and "def fail(" in reference
    for script, block in blocks.items():
        assert block == reference, f"{script}'s runtime block differs from {SCRIPTS[0]}'s: copy it over"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_algorithm_comes_first_and_the_runtime_last(script):
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    definitions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    for order in (ALGORITHM_ORDER + AFTER_MAIN, ALSO_IN_ORDER[script]):
        starts = [definitions[name].lineno for name in order]
        assert starts == sorted(starts), f"{script}: expected {order} in this order"
    sizes = {name: node.end_lineno - node.lineno + 1 for name, node in definitions.items()}
    assert max(sizes, key=sizes.get) == "main", f"{script}: main is not its largest definition: {sizes}"
    main = definitions["main"]
    runtime_line = source[: source.index(RUNTIME_START)].count("\n") + 1
    assert main.end_lineno < runtime_line
    # nothing of the algorithm after the runtime block: only the entry point
    assert source[source.index(RUNTIME_END) :].count("\ndef ") == 0
    assert source.rstrip().endswith('if __name__ == "__main__":\n    main(tyro.cli(Args))')


@pytest.mark.parametrize("script", SCRIPTS)
def test_importing_a_script_does_no_work(script, tmp_path):
    """Import only: no process group, no env, no file written, nothing printed."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {script[:-3]}"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_top_level_name_is_one_of_torch_or_gymnasium(script):
    """A reader who knows torch.distributed, torch.nn and gymnasium's wrappers and vector envs never meets their names
    for something else (a `broadcast` with another signature, a wrapper that is not gymnasium's)."""
    taken = {
        name: module.__name__
        for module in (torch.distributed, torch.nn, gymnasium.wrappers, gymnasium.vector)
        for name in getattr(module, "__all__", None) or [name for name in dir(module) if not name.startswith("_")]
    }
    names = set()
    for node in ast.parse((ROOT / script).read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    assert not {name: taken[name] for name in names if name in taken}
