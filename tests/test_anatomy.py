"""The three scripts read alike (docs/design.md, "Anatomy of a script"): the algorithm first, in the order a CleanRL
reader looks for it, then `main`, whose loop tells one iteration and calls only what is defined above it or in the
runtime, and last one runtime block of plain functions, the same text in every script."""

import ast
import builtins
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
# what a reader who knows CleanRL looks for, in this order, each piece before its first use, and main last
ALGORITHM_ORDER = ("Args", "derive_batch_sizes", "make_env", "layer_init", "Agent", "compute_gae", "update", "main")
ALSO_IN_ORDER = {  # a script's own pieces, where its reader meets them
    "ppo_continuous_mpi.py": (
        "RunningMeanStd",
        "GaussianActions",
        "Agent",
        "RolloutPolicy",
        "check_rollout_policy",
        "update",
        "gather_to_learner",
        "update_one_learner",
        "explained_variance",
        "check_args",
        "evaluate_checkpoint",
        "main",
    ),
    "vpg_mpi.py": (
        "GaussianActions",
        "CategoricalActions",
        "Agent",
        "RolloutPolicy",
        "check_rollout_policy",
        "update",
        "gather_to_learner",
        "update_one_learner",
        "explained_variance",
        "check_args",
        "evaluate_checkpoint",
        "main",
    ),
    "ppo_atari_multigpu.py": (
        "CategoricalActions",
        "Agent",
        "RolloutPolicy",
        "acting_step",
        "check_rollout_policy",
        "update",
        "explained_variance",
        "check_args",
        "evaluate_checkpoint",
        "main",
    ),
}


def runtime_block(script: str) -> str:
    """The text between the runtime markers (the banner lines included)."""
    lines = (ROOT / script).read_text().splitlines(keepends=True)
    [start] = [i for i, line in enumerate(lines) if line.startswith(RUNTIME_START)]
    [end] = [i for i, line in enumerate(lines) if line.startswith(RUNTIME_END)]
    return "".join(lines[start - 1 : end + 2])


def parts(script: str) -> tuple[dict[str, ast.AST], dict[str, ast.AST], ast.FunctionDef, ast.Module]:
    """The top-level definitions before the runtime block and in it (by name), `main`, and the module."""
    source = (ROOT / script).read_text()
    tree = ast.parse(source)
    runtime_line = source[: source.index(RUNTIME_START)].count("\n") + 1
    definitions = [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)]
    algorithm = {node.name: node for node in definitions if node.lineno < runtime_line}
    runtime = {node.name: node for node in definitions if node.lineno > runtime_line}
    return algorithm, runtime, algorithm["main"], tree


def test_the_runtime_block_is_the_same_text_in_every_script():
    blocks = {script: runtime_block(script) for script in SCRIPTS}
    reference = blocks[SCRIPTS[0]]
    assert "def start_run(" in reference and "def fail(" in reference
    for script, block in blocks.items():
        assert block == reference, f"{script}'s runtime block differs from {SCRIPTS[0]}'s: copy it over"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_algorithm_comes_first_main_last_and_the_runtime_after(script):
    algorithm, runtime, main, tree = parts(script)
    for order in (ALGORITHM_ORDER, ALSO_IN_ORDER[script]):
        starts = [algorithm[name].lineno for name in order]
        assert starts == sorted(starts), f"{script}: expected {order} in this order"
    assert max(algorithm.values(), key=lambda node: node.lineno) is main, (
        f"{script}: something of the algorithm follows main"
    )
    sizes = {name: node.end_lineno - node.lineno + 1 for name, node in {**algorithm, **runtime}.items()}
    assert max(sizes, key=sizes.get) == "main", f"{script}: main is not its largest definition: {sizes}"
    source = (ROOT / script).read_text()
    assert source[source.index(RUNTIME_END) :].count("\ndef ") == 0  # after the runtime: only the entry point
    assert source.rstrip().endswith('if __name__ == "__main__":\n    main(tyro.cli(Args))')


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_calls_only_what_is_defined_above_it_or_in_the_runtime(script):
    """A reader follows an iteration without leaving main for anything defined below it but the fenced runtime."""
    algorithm, runtime, main, tree = parts(script)
    imported = {
        alias.asname or alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    called = {node.func.id for node in ast.walk(main) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    made_in_main = {
        node.id for node in ast.walk(main) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    unknown = called - algorithm.keys() - runtime.keys() - imported - made_in_main - set(dir(builtins))
    assert not unknown, f"{script}: main calls {sorted(unknown)}, defined nowhere above it or in the runtime"
    below = [name for name in called & algorithm.keys() if algorithm[name].lineno > main.lineno]
    assert not below, below


@pytest.mark.parametrize("script", SCRIPTS)
def test_mains_loop_is_bounded_in_main_and_the_runtime_is_plain_calls(script):
    """The training loop is a `while` on a condition main owns (or a `for` over a range), never a generator of the
    runtime's; main enters no context manager; the runtime has no generator, no context manager and no class that
    inherits from another of its classes."""
    algorithm, runtime, main, tree = parts(script)
    loops = [node for node in ast.walk(main) if isinstance(node, ast.While | ast.For)]
    training = [
        loop
        for loop in loops
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "update" for n in ast.walk(loop))
    ]
    [outermost] = [
        loop for loop in training if not any(loop is not other and loop in ast.walk(other) for other in training)
    ]
    if isinstance(outermost, ast.While):
        assert isinstance(outermost.test, ast.Compare), (
            f"{script}: main's loop runs while {ast.unparse(outermost.test)}"
        )
    else:
        assert isinstance(outermost.iter, ast.Call) and getattr(outermost.iter.func, "id", "") == "range"
    for loop in loops:
        if isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call):
            assert getattr(loop.iter.func, "id", "") not in runtime, (
                f"{script}: main loops over {ast.unparse(loop.iter)}"
            )
    assert not [node for node in ast.walk(main) if isinstance(node, ast.With)], f"{script}: main enters a context"
    for node in runtime.values():
        assert not [n for n in ast.walk(node) if isinstance(n, ast.Yield | ast.YieldFrom)], (
            f"{node.name} is a generator"
        )
        decorators = [ast.unparse(decorator) for decorator in getattr(node, "decorator_list", [])]
        assert not [d for d in decorators if "contextmanager" in d], f"{node.name} is a context manager"
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(base) for base in node.bases}
            assert not bases & runtime.keys(), f"the runtime's {node.name} inherits from {bases & runtime.keys()}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_packed_assignments_in_the_algorithm(script):
    """One statement per line, as CleanRL writes it: `a, b = x, y` only where the values come together (a call's
    results, one tuple), never to fit two statements on one line."""
    algorithm, _, _, _ = parts(script)
    packed = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for definition in algorithm.values()
        for node in ast.walk(definition)
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Tuple) for target in node.targets)
        and isinstance(node.value, ast.Tuple)
    ]
    assert not packed, f"{script}: " + "; ".join(packed)


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
