"""The three scripts read alike (docs/design.md, "Anatomy of a script"): the algorithm in the order a CleanRL reader
looks for it, an Agent in CleanRL's words, then `main`, whose loop tells one iteration and calls only what the script
defines above it or what the ddrl package defines, the run's life in the Run's few calls; the package reads module by
module, and no script defines what the package does."""

import ast
import builtins
import subprocess
import sys
from pathlib import Path

import gymnasium.vector
import gymnasium.wrappers
import pytest
import torch.distributed
import torch.nn

from tests.helpers import ROOT

SCRIPTS = ("ppo_continuous_mpi.py", "ppo_atari_multigpu.py", "vpg_mpi.py")
PACKAGE = sorted((ROOT / "ddrl").glob("*.py"))
# what a reader who knows CleanRL looks for, in this order, each piece before its first use, and main last
ALGORITHM_ORDER = ("Args", "derive_batch_sizes", "make_env", "layer_init", "Agent", "compute_gae", "update", "main")
ALSO_IN_ORDER = {  # a script's own pieces, where its reader meets them
    "ppo_continuous_mpi.py": (
        "Agent",
        "compute_gae",
        "minibatch_loss",
        "minibatch_sizes",
        "minibatches",
        "average_gradients",
        "update",
        "main",
    ),
    "vpg_mpi.py": ("mlp", "Agent", "compute_gae", "average_gradients", "update", "main"),
    "ppo_atari_multigpu.py": (
        "make_env",
        "Agent",
        "compute_gae",
        "ActionAndValue",
        "minibatch_loss",
        "minibatch_sizes",
        "minibatches",
        "update",
        "main",
    ),
}
RUN_LIFE = ("start", "resume", "log", "check_in_sync", "checkpoint", "finish")  # the Run's calls, in main's order


def tree_of(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def definitions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """The module's top-level functions and classes, by name."""
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def package_definitions() -> dict[str, dict[str, ast.AST]]:
    """ddrl's modules by name, each with its top-level definitions by name."""
    return {path.stem: definitions(tree_of(path)) for path in PACKAGE if path.stem != "__init__"}


def parts(script: str) -> tuple[dict[str, ast.AST], ast.FunctionDef, ast.Module]:
    """The script's top-level definitions (by name), its `main`, and the module."""
    tree = tree_of(ROOT / script)
    found = definitions(tree)
    return found, found["main"], tree


def packed_assignments(tree: ast.AST) -> list[str]:
    """`a, b = x, y`: two statements on one line (a call's results or one tuple unpacked are one statement)."""
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Tuple) for target in node.targets)
        and isinstance(node.value, ast.Tuple)
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_algorithm_comes_in_a_cleanrl_readers_order_and_main_last(script):
    found, main, tree = parts(script)
    for order in (ALGORITHM_ORDER, ALSO_IN_ORDER[script]):
        starts = [found[name].lineno for name in order]
        assert starts == sorted(starts), f"{script}: expected {order} in this order"
    assert max(found.values(), key=lambda node: node.lineno) is main, f"{script}: something follows main"
    sizes = {name: node.end_lineno - node.lineno + 1 for name, node in found.items()}
    assert max(sizes, key=sizes.get) == "main", f"{script}: main is not its largest definition: {sizes}"
    source = (ROOT / script).read_text()
    assert source.rstrip().endswith('if __name__ == "__main__":\n    main(tyro.cli(Args))')


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_imports_the_runtime_and_defines_none_of_it(script):
    """The plumbing lives once, in ddrl; a script imports its modules by name and repeats none of their definitions
    (the small algorithm helpers two scripts share, like compute_gae, are the scripts' own)."""
    found, _, tree = parts(script)
    in_package = {name: module for module, names in package_definitions().items() for name in names}
    repeated = {name: in_package[name] for name in found if name in in_package}
    assert not repeated, f"{script} defines what ddrl defines: {repeated}"
    imported = [
        node for node in tree.body if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddrl")
    ]
    assert imported, f"{script} does not import ddrl"


def code_nodes(node: ast.AST):
    """ast.walk without annotations: a type named is not code that runs."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        for field, value in ast.iter_fields(current):
            children = value if isinstance(value, list) else [value]
            if field not in ("annotation", "returns"):
                todo += [child for child in children if isinstance(child, ast.AST)]


def reached_in_one_iteration(script: str) -> set[str]:
    """The script's definitions one iteration of main's loop reaches (one_iteration_walk)."""
    return {name for module, name in one_iteration_walk(script) if module == "<script>"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_iteration_reaches_a_dozen_definitions_at_most(script):
    """CleanRL's iteration reaches 2 definitions of its file, read in order; ours may reach 12 (design.md,
    "Budgets"): the rest of what an iteration runs is the package's, called by module name."""
    reached = reached_in_one_iteration(script)
    assert 1 < len(reached) <= 12, f"{script}: one iteration reaches {len(reached)} definitions: {sorted(reached)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_main_calls_only_what_is_defined_above_it_or_in_the_package(script):
    """A reader follows an iteration without leaving main for anything defined below it; a call into the package names
    the module it lives in (`checkpoints.save`), and that module defines it."""
    found, main, tree = parts(script)
    package = package_definitions()
    modules = {
        alias.asname or alias.name: alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "ddrl"
        for alias in node.names
    }
    modules["ddrl"] = "run"  # `ddrl.launch` is ddrl/run.py's launch
    imported = {
        alias.asname or alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    calls = [node for node in ast.walk(main) if isinstance(node, ast.Call)]
    called = {node.func.id for node in calls if isinstance(node.func, ast.Name)}
    made_in_main = {
        node.id for node in ast.walk(main) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    unknown = called - found.keys() - imported - made_in_main - set(dir(builtins))
    assert not unknown, f"{script}: main calls {sorted(unknown)}, defined nowhere above it or in ddrl"
    below = [name for name in called & found.keys() if found[name].lineno > main.lineno]
    assert not below, below
    into_package = [
        (node.func.value.id, node.func.attr)
        for node in calls
        if isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in modules
    ]
    assert into_package, f"{script}: main calls nothing of ddrl"
    for module, name in into_package:
        assert name in package[modules[module]], f"{script}: main calls {module}.{name}, which ddrl/{module}.py lacks"
    run_methods = {node.name for node in package["run"]["Run"].body if isinstance(node, ast.FunctionDef)}
    on_run = [
        node.func.attr
        for node in calls
        if isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "run"
    ]
    assert set(on_run) <= run_methods, f"{script}: main calls run.{sorted(set(on_run) - run_methods)}, which Run lacks"


@pytest.mark.parametrize("script", SCRIPTS)
def test_mains_loop_is_bounded_in_main(script):
    """The training loop is a `while` on a condition main owns (or a `for` over a range), never a generator of the
    package's; main enters no context manager."""
    _, main, _ = parts(script)
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
            assert isinstance(loop.iter.func, ast.Name), f"{script}: main loops over {ast.unparse(loop.iter)}"
    assert not [node for node in ast.walk(main) if isinstance(node, ast.With)], f"{script}: main enters a context"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_agent_is_cleanrls_get_value_and_get_action_and_value_over_torch_distributions(script):
    """A reader who knows CleanRL finds its Agent: __init__, get_value(x) and get_action_and_value(x, action=None),
    which builds a torch.distributions distribution; nothing written for a fast path (the package derives those)."""
    found, _, tree = parts(script)
    methods = {node.name: node for node in found["Agent"].body if isinstance(node, ast.FunctionDef)}
    assert set(methods) == {"__init__", "get_value", "get_action_and_value"}, sorted(methods)
    arguments = methods["get_action_and_value"].args
    assert [argument.arg for argument in arguments.args] == ["self", "x", "action"]
    assert ast.unparse(arguments.defaults[-1]) == "None"
    assert [argument.arg for argument in methods["get_value"].args.args] == ["self", "x"]
    distributions = {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributions")
        for alias in node.names
    }
    built = {
        getattr(node.func, "id", None)
        for node in ast.walk(methods["get_action_and_value"])
        if isinstance(node, ast.Call)
    }
    assert built & distributions, f"{script}: get_action_and_value builds none of {sorted(distributions)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_runs_life_reads_from_main_as_the_runs_few_calls_in_order(script):
    """launch, then start (the folder is made there and nowhere else), resume, and in the loop log, the sync check,
    checkpoint; finish last. main calls no module that makes folders or files itself."""
    _, main, _ = parts(script)
    calls = sorted(
        (node.lineno, node.func.attr)
        for node in ast.walk(main)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "run"
    )
    first = {}
    for line, name in calls:
        first.setdefault(name, line)
    assert [name for name in RUN_LIFE if name in first] == list(RUN_LIFE), f"{script}: main calls {first}"
    assert [first[name] for name in RUN_LIFE] == sorted(first[name] for name in RUN_LIFE), f"{script}: {first}"
    writers = {"run_folders", "checkpoints", "launching", "stopping"}
    direct = {
        ast.unparse(node.func.value)
        for node in ast.walk(main)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not direct & writers, f"{script}: main calls {sorted(direct & writers)} itself"


@pytest.mark.parametrize("path", PACKAGE, ids=[path.name for path in PACKAGE])
def test_the_package_reads_module_by_module(path):
    """Each module says what it holds in its docstring; no generator, no context manager, no class that inherits from
    another of ddrl's classes, so every function can be read alone."""
    tree = tree_of(path)
    assert ast.get_docstring(tree), f"ddrl/{path.name} has no docstring"
    ours = {name for names in package_definitions().values() for name in names}
    for node in definitions(tree).values():
        assert not [n for n in ast.walk(node) if isinstance(n, ast.Yield | ast.YieldFrom)], (
            f"{node.name} is a generator"
        )
        decorators = [ast.unparse(decorator) for decorator in getattr(node, "decorator_list", [])]
        assert not [d for d in decorators if "contextmanager" in d], f"{node.name} is a context manager"
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(base).split(".")[-1] for base in node.bases}
            assert not bases & ours, f"ddrl's {node.name} inherits from {bases & ours}"


def names_read(function: ast.FunctionDef, names: set[str]) -> set[str]:
    """Which of `names` the function reads, leaving out a name it binds itself (an argument, a local)."""
    bound = {
        arg.arg
        for node in ast.walk(function)
        if isinstance(node, ast.arguments)
        for arg in (*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg)
        if arg
    }
    used = [node for node in ast.walk(function) if isinstance(node, ast.Name)]
    bound |= {node.id for node in used if not isinstance(node.ctx, ast.Load)}
    return {node.id for node in used if isinstance(node.ctx, ast.Load)} & names - bound - {function.name}


@pytest.mark.parametrize("path", PACKAGE, ids=[path.name for path in PACKAGE])
def test_each_module_reads_callers_before_helpers(path):
    """A reader meets a function before its helpers, one rule in every module: each function comes above the functions
    of its module it names, except where Python needs otherwise (one a module-level statement names, as a table does;
    functions that call each other)."""
    tree = tree_of(path)
    functions = {name: node for name, node in definitions(tree).items() if isinstance(node, ast.FunctionDef)}
    place = {name: index for index, name in enumerate(functions)}
    calls = {name: names_read(node, set(functions)) for name, node in functions.items()}
    named_at_import = {
        node.id
        for statement in tree.body
        if not isinstance(statement, ast.FunctionDef | ast.ClassDef)
        for node in ast.walk(statement)
        if isinstance(node, ast.Name)
    }
    reaches = {}  # each function's helpers, direct or not
    for name in functions:
        reaches[name] = set()
        todo = [name]
        while todo:
            new = calls[todo.pop()] - reaches[name]
            reaches[name] |= new
            todo += new
    above = [
        f"{name} calls {helper}, defined above it"
        for name in functions
        for helper in sorted(calls[name])
        if place[helper] < place[name] and helper not in named_at_import and name not in reaches[helper]
    ]
    assert not above, f"ddrl/{path.name}: " + "; ".join(above)


@pytest.mark.parametrize("path", [ROOT / script for script in SCRIPTS] + PACKAGE, ids=lambda path: path.name)
def test_no_packed_assignments(path):
    """One statement per line, as CleanRL writes it: `a, b = x, y` only where the values come together (a call's
    results, one tuple), never to fit two statements on one line."""
    packed = packed_assignments(tree_of(path))
    assert not packed, f"{path.name}: " + "; ".join(packed)


@pytest.mark.parametrize("modules", [*([script[:-3]] for script in SCRIPTS), ["ddrl." + path.stem for path in PACKAGE]])
def test_importing_a_script_or_the_package_does_no_work(modules, tmp_path):
    """Import only: no process group, no env, no file written, nothing printed."""
    imports = "; ".join(f"import {module.removesuffix('.__init__')}" for module in modules)
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); {imports}"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", [ROOT / script for script in SCRIPTS] + PACKAGE, ids=lambda path: path.name)
def test_no_top_level_name_is_one_of_torch_or_gymnasium(path):
    """A reader who knows torch.distributed, torch.nn and gymnasium's wrappers and vector envs never meets their names
    for something else (a `broadcast` with another signature, a wrapper that is not gymnasium's)."""
    taken = {
        name: module.__name__
        for module in (torch.distributed, torch.nn, gymnasium.wrappers, gymnasium.vector)
        for name in getattr(module, "__all__", None) or [name for name in dir(module) if not name.startswith("_")]
    }
    names = set()
    for node in tree_of(path).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    assert not {name: taken[name] for name in names if name in taken}


def package_reached_in_one_iteration(script: str, root: Path = ROOT) -> dict[str, int]:
    """The ddrl definitions one iteration of `script`'s loop reaches (one_iteration_walk), with each one's lines; a
    method inside a counted class is not counted twice."""
    counted = {key: node for key, node in one_iteration_walk(script, root).items() if key[0] != "<script>"}
    return {
        f"{module}.{name}": node.end_lineno - node.lineno + 1
        for (module, name), node in counted.items()
        if not ("." in name and (module, name.split(".")[0]) in counted)
    }


def one_iteration_walk(script: str, root: Path = ROOT) -> dict[tuple[str, str], ast.AST]:
    """What one iteration of `script`'s loop reaches, by (module, definition; "<script>" for the script's own): a
    static walk from main's loop through the names it uses: the script's functions, a class's __init__,
    __post_init__ and forward where it is built, the script's methods by the attribute called; and into the
    package: `module.name`, a name imported from a ddrl module or defined in the module it is used in, `run.method`
    (the Run), `self.method` (the enclosing class), and a method called on a name assigned from a package call, for
    the package classes that call's return annotation names."""
    trees = {path.stem: tree_of(path) for path in sorted((root / "ddrl").glob("*.py")) if path.stem != "__init__"}
    trees["<script>"] = tree_of(root / script)
    found = {}  # (module, "name" or "Class.method") -> node
    scopes = {}  # module -> {name used there: (module, name) or ("<module>", module)}
    for module, tree in trees.items():
        scope = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                found[(module, node.name)] = node
                scope[node.name] = (module, node.name)
            for item in node.body if isinstance(node, ast.ClassDef) else []:
                if isinstance(item, ast.FunctionDef):
                    found[(module, f"{node.name}.{item.name}")] = item
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "ddrl":
                scope |= {alias.asname or alias.name: ("<module>", alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddrl."):
                imported = node.module.split(".")[1]
                scope |= {alias.asname or alias.name: (imported, alias.name) for alias in node.names}
        scopes[module] = scope

    def built(key: tuple[str, str]) -> list[tuple[str, str]]:
        node = found.get(key)
        if not isinstance(node, ast.ClassDef):
            return [key] if key in found else []
        return [(key[0], f"{key[1]}.{item}") for item in ("__init__", "__post_init__", "forward")]

    def annotated_classes(function: ast.AST, module: str) -> list[tuple[str, str]]:
        returns = getattr(function, "returns", None)
        names = [node.id for node in ast.walk(returns) if isinstance(node, ast.Name)] if returns else []
        return [scopes[module][name] for name in names if name in scopes[module]]

    def target_of(node: ast.AST, module: str) -> tuple[str, str] | None:
        scope = scopes[module]
        if isinstance(node, ast.Name) and node.id in scope and scope[node.id][0] != "<module>":
            return scope[node.id]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in scope:
            home = scope[node.value.id]
            return (home[1], node.attr) if home[0] == "<module>" else None
        return None

    script_methods = {}
    for module, name in found:
        if module == "<script>" and "." in name:
            script_methods.setdefault(name.split(".")[1], []).append((module, name))
    main = found[("<script>", "main")]
    loop = next(node for node in ast.walk(main) if isinstance(node, ast.While))
    typed = {"run": [("run", "Run")]}  # names whose package classes are known, from main and the package alike
    for node in ast.walk(main):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called = target_of(node.value.func, "<script>")
            if called in found:
                built_here = isinstance(found[called], ast.ClassDef)
                kinds = [called] if built_here else annotated_classes(found[called], called[0])
                for target in node.targets:
                    if isinstance(target, ast.Name) and kinds:
                        typed[target.id] = kinds
    reached = {}
    todo = [("<script>", None, loop)]
    while todo:
        module, home_class, body = todo.pop()
        for node in code_nodes(body):
            keys = []
            if isinstance(node, ast.Name | ast.Attribute) and (key := target_of(node, module)):
                keys += [] if key == ("<script>", "main") else built(key)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = node.value.id
                if owner == "self" and home_class:
                    keys.append((module, f"{home_class}.{node.attr}"))
                for kind_module, kind in typed.get(owner, []) if owner != "self" else []:
                    keys.append((kind_module, f"{kind}.{node.attr}"))
                if module == "<script>":
                    keys += script_methods.get(node.attr, [])
            for key in keys:
                if key in found and key not in reached:
                    reached[key] = found[key]
                    owner_class = key[1].split(".")[0] if "." in key[1] else None
                    todo.append((key[0], owner_class, found[key]))
    return reached


def package_imports() -> dict[str, set[str]]:
    """Each ddrl module's imports of other ddrl modules, counting every import statement (those under
    `if TYPE_CHECKING:` and inside functions too)."""
    modules = {path.stem for path in PACKAGE} - {"__init__"}
    imports = {}
    for path in PACKAGE:
        found = set()
        for node in ast.walk(tree_of(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "ddrl":
                found |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddrl."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("ddrl.")}
        imports[path.stem] = found - {path.stem}
    return imports


def test_the_package_is_layered_without_a_circle():
    """No module imports, through any chain of imports (TYPE_CHECKING ones included), a module that imports it: the
    package reads bottom up, each module against the ones below it (docs/design.md, "The package")."""
    imports = package_imports()
    imports.pop("__init__")
    for start in imports:
        todo = list(imports[start])
        seen = set()
        while todo:
            module = todo.pop()
            assert module != start, f"ddrl.{start} reaches itself through its imports"
            if module not in seen:
                seen.add(module)
                todo += imports.get(module, [])


def test_only_run_knows_the_run_and_the_run_holds_a_dozen_fields_at_most():
    """Each part of a run keeps its state in an object of its own module; the Run composes them, and no other module
    is written against it."""
    for path in PACKAGE:
        named = {
            alias.name
            for node in ast.walk(tree_of(path))
            if isinstance(node, ast.ImportFrom) and node.module in ("ddrl.run", "ddrl")
            for alias in node.names
        }
        assert path.stem in ("run", "__init__") or "Run" not in named, f"ddrl/{path.name} imports the Run"
    run_class = package_definitions()["run"]["Run"]
    fields = [node.target.id for node in run_class.body if isinstance(node, ast.AnnAssign)]
    assert len(fields) <= 12, f"Run has {len(fields)} fields: {fields}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_iteration_reaches_what_the_algorithm_needs_of_the_package(script):
    """What an iteration runs of the package is the algorithm's: the rollout's Agent is derived before the loop, and
    the checks that can run once run at start (docs/design.md, "Budgets")."""
    reached = package_reached_in_one_iteration(script)
    derivation = {"rollout.derive", "rollout.traced", "tracing.trace", "tracing.numpy_program"}
    assert not derivation & set(reached), f"{script}'s loop derives the rollout: {sorted(derivation & set(reached))}"
