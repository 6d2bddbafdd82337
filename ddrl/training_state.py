"""What a run trains with, found rather than named (registration hooks installed at import), so that
the sync check and verify compare what a copy trains with: a second module, optimizer, number."""

import ast
import functools
import inspect
import textwrap
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

# (the module, "parameter" or "buffer", its name there), in the order torch registered them
REGISTERED: list[tuple[weakref.ref, str, str]] = []
SEEN = weakref.WeakKeyDictionary()  # module: the (kind, name) pairs of it in REGISTERED
STEPPED = weakref.WeakKeyDictionary()  # optimizer: the steps it took in this process
NUMBERS = (int, float, np.number, np.bool_)


@dataclass
class TrainingState:
    """One process's training state, named as main reaches it (`agent.critic.0.weight`)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    gradients: dict[str, torch.Tensor | None] = field(default_factory=dict)
    numbers: dict[str, float] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)


def found(frame, args=None) -> TrainingState:
    """The training state of this process as `frame` (main's, in its loop) sees it."""
    local = frame.f_locals
    values = list(local.values())
    values += [item for value in values if isinstance(value, list | tuple) for item in value]
    values += [item for value in values if isinstance(value, dict) for item in value.values()]
    alive = [(ref(), kind, name) for ref, kind, name in REGISTERED]
    REGISTERED[:] = [entry for entry, (module, *_) in zip(REGISTERED, alive, strict=True) if module]
    alive = [entry for entry in alive if entry[0] is not None]
    # copy.deepcopy and pickle register nothing: the modules main holds are taken as they stand
    held = {id(module) for module, _, _ in alive}
    roots = [value for value in values if isinstance(value, nn.Module)]
    for module in [inner for root in roots for inner in root.modules()]:
        if id(module) not in held:
            held.add(id(module))
            alive += [(module, "parameter", name) for name in module._parameters]
            alive += [(module, "buffer", name) for name in module._buffers]
    # torch.fx's GraphModules (a trace, torch.compile's graphs) hold a module's tensors again
    alive = [entry for entry in alive if not isinstance(entry[0], fx.GraphModule)]
    modules = list({id(module): module for module, _, _ in alive}.values())
    paths = module_paths(local, modules)
    state = TrainingState()
    order = {}  # id of a tensor: its place among the tensors
    for module, kind, name in alive:
        tensor = getattr(module, f"_{kind}s").get(name)
        if tensor is None or id(tensor) in order or tensor.is_meta:
            continue
        if kind == "parameter" or tensor.is_floating_point():
            order[id(tensor)] = len(order)
            state.tensors[f"{paths[module]}.{name}"] = tensor
    names = {id(tensor): name for name, tensor in state.tensors.items()}
    optimizers = {id(value): value for value in values if isinstance(value, torch.optim.Optimizer)}
    optimizers |= {id(optimizer): optimizer for optimizer in list(STEPPED.keys())}
    # matched between runs by what they hold (their first registered parameter), never by name
    ranked = sorted(optimizers.values(), key=lambda optimizer: min(
        (order.get(id(p), len(order)) for g in optimizer.param_groups for p in g["params"]),
        default=len(order)))  # fmt: skip
    called = {id(value): name for name, value in local.items()}
    for index, optimizer in enumerate(ranked):
        name = called.get(id(optimizer), f"optimizer {index}")
        state.optimizers[name] = optimizer
        for number, group in enumerate(optimizer.param_groups):
            where = f" (parameter group {number})" if len(optimizer.param_groups) > 1 else ""
            for key, value in group.items():
                if key != "params":
                    add_numbers(state.numbers, f"{name}'s {key}{where}", value)
            for parameter in group["params"]:
                if id(parameter) in names:
                    state.gradients[names[id(parameter)]] = parameter.grad
    for name in carried_names(frame.f_code):
        if name in local:
            add_numbers(state.numbers, name, local[name], scalars_only=True)
    for module in modules:
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training":
                add_numbers(state.numbers, f"{paths[module]}.{key}", value, scalars_only=True)
    for key, value in (vars(args) if args is not None else {}).items():
        add_numbers(state.numbers, f"args.{key}", value)
    return state


def module_paths(local: dict, modules: list[nn.Module]) -> dict[nn.Module, str]:
    """Each module's name as main reaches it, the shortest path from one of its variables
    (`agent.critic.0`); else its class and place (`RNDModel 2`)."""
    paths = {}
    for name, value in sorted(local.items()):
        roots = [(name, value)] if isinstance(value, nn.Module) else []
        if isinstance(value, list | tuple | dict):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            roots = [
                (f"{name}[{key!r}]", item) for key, item in items if isinstance(item, nn.Module)
            ]
        for root, module in roots:
            for path, inner in module.named_modules(prefix=root):
                if inner not in paths or len(path) < len(paths[inner]):
                    paths[inner] = path
    for index, module in enumerate(modules):
        paths.setdefault(module, f"{type(module).__name__} {index}")
    return paths


def add_numbers(numbers: dict, name: str, value, scalars_only: bool = False) -> None:
    """`value` into `numbers` as floats, where it is a number or holds numbers; with `scalars_only`,
    arrays and tensors count only when they have no dimension (one env's per-env array is none)."""
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.ndim == 0 or (not scalars_only and np.prod(tuple(value.shape)) == 1):
            numbers[name] = float(value.item())
    elif isinstance(value, NUMBERS):
        numbers[name] = float(value)
    elif isinstance(value, tuple | list) and not scalars_only:
        for index, item in enumerate(value):
            add_numbers(numbers, f"{name}[{index}]", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            add_numbers(numbers, f"{name}[{key!r}]", item, scalars_only)


@functools.cache
def carried_names(code) -> tuple[str, ...]:
    """The names the first `while` loop of `code`'s function carries from one iteration to the
    next: written in the loop and read there before they are first assigned."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return ()
    loop = next((node for node in ast.walk(tree) if isinstance(node, ast.While)), None)
    if loop is None:
        return ()
    events = []  # (where, name, read?) in the order Python runs them, near enough
    written = set()
    for node in ast.walk(loop):
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.NamedExpr | ast.For):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            # a target is written after its value is read; a for loop's before its body runs
            end = (node.end_lineno, node.end_col_offset)
            end = (node.lineno, node.col_offset) if isinstance(node, ast.For) else end
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    events.append((end, name.id, isinstance(node, ast.AugAssign)))
                    written.add(name.id)
        if isinstance(node, ast.Subscript | ast.Attribute) and isinstance(node.ctx, ast.Store):
            base = node.value
            while isinstance(base, ast.Subscript | ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name):
                written.add(base.id)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            events.append(((node.lineno, node.col_offset), node.id, True))
    first = {}
    for _, name, read in sorted(events, key=lambda event: event[0]):
        first.setdefault(name, read)
    return tuple(name for name in sorted(written) if first.get(name))


def remember(module: nn.Module, kind: str, name: str) -> None:
    """A registration hook's record of one parameter or buffer, once per module and name."""
    names = SEEN.setdefault(module, set())
    if (kind, name) not in names:
        names.add((kind, name))
        REGISTERED.append((weakref.ref(module), kind, name))


def count_step(optimizer: torch.optim.Optimizer, *_) -> None:
    STEPPED[optimizer] = STEPPED.get(optimizer, 0) + 1


nn.modules.module.register_module_parameter_registration_hook(
    lambda module, name, _: remember(module, "parameter", name)
)
nn.modules.module.register_module_buffer_registration_hook(
    lambda module, name, _: remember(module, "buffer", name)
)
register_optimizer_step_post_hook(count_step)
