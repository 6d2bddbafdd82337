"""The Agent's get_action_and_value(x) and get_value(x) traced once with torch.fx, and each trace as
a numpy program over views of the Agent's parameters and buffers; the entropy dropped."""

import copy
import functools
import types
from collections.abc import Callable

import torch
import torch.distributions as D
import torch.fx as fx
import torch.nn as nn

from ddrl import failures
from ddrl.numpy_versions import (
    DISTRIBUTIONS,
    DTYPES,
    FUNCTIONS,
    METHODS,
    SAME_IN_NUMPY,
    TRANSFORMS,
    NoNumpyVersion,
    NumpyTransform,
    layer_parameters,
    no_numpy_version,
    numpy_layer,
    view_of,
)

RECORDED = (D.Distribution, D.Transform)  # tracing replaces the names of their subclasses a while
ENTROPY = 2  # its place among get_action_and_value's results
# the arguments a program's code writes as they are; any other value is one of its constants
LITERALS = (type(None), bool, int, float, str)


class AgentMethod(nn.Module):
    """One method of the Agent as a module's forward, which torch.fx traces."""

    def __init__(self, agent: nn.Module, method: str):
        super().__init__()
        self.agent = agent
        self.method = method

    def forward(self, x, action=None):
        if self.method == "get_value":
            return self.agent.get_value(x)
        return self.agent.get_action_and_value(x, action)


class DistributionTracer(fx.Tracer):
    """torch.fx's tracer, keeping distributions and transforms built of constants as they are, and
    buffers as references, never as the values they had when traced."""

    proxy_buffer_attributes = True

    def create_arg(self, a):
        if isinstance(a, RECORDED):
            # traced values inside an object: the graph would not have them as inputs
            if holds(getattr(a, "__dict__", {}), fx.Proxy):
                raise TypeError(
                    f"the {type(a).__name__} holds traced tensors, built under a name ddrl does "
                    "not record (a class of torch.distributions, or a name in the Agent's module)"
                )
            return a
        return super().create_arg(a)


def trace(agent: nn.Module, method: str) -> tuple[AgentMethod, fx.Graph]:
    """`agent.method(x)` as a torch.fx graph: a distribution or transform built from tensors is one
    node, so every tensor it holds is an input; the entropy is None."""
    tracer = DistributionTracer()
    building = [0]  # real ones being built: torch's constructors build their parts for real

    def record(cls):
        @functools.wraps(cls)
        def build(*args, **kwargs):
            if building[0] == 0 and holds((args, kwargs), fx.Proxy | torch.Tensor):
                return tracer.create_proxy("call_function", cls, args, kwargs)
            building[0] += 1
            try:
                return cls(*args, **kwargs)
            finally:
                building[0] -= 1

        return build

    patched = []
    for namespace in distribution_namespaces(agent):
        for name, value in list(namespace.items()):
            if isinstance(value, type) and issubclass(value, RECORDED) and value not in RECORDED:
                patched.append((namespace, name, value))
                namespace[name] = record(value)
    root = AgentMethod(agent, method)
    try:
        concrete = None if method == "get_value" else {"action": None}
        graph = tracer.trace(root, concrete_args=concrete)
    finally:
        for namespace, name, value in patched:
            namespace[name] = value
    output = graph.output_node()
    if isinstance(output.args[0], tuple):  # get_action_and_value's entropy: None
        output.args = (
            tuple(None if place == ENTROPY else r for place, r in enumerate(output.args[0])),
        )
    graph.eliminate_dead_code(lambda node: node.op in ("placeholder", "output"))
    return root, graph


def distribution_namespaces(agent: nn.Module) -> list[dict]:
    """Where the Agent's code may find a distribution or transform class: its methods' globals,
    torch.distributions and its submodules."""
    namespaces = {}
    for module in agent.modules():
        for cls in type(module).__mro__:
            for value in vars(cls).values():
                if isinstance(value, types.FunctionType):
                    namespaces[id(value.__globals__)] = value.__globals__
    modules = [D, *(value for value in vars(D).values() if isinstance(value, types.ModuleType))]
    return [*namespaces.values(), *(vars(module) for module in modules)]


def numpy_program(root: nn.Module, graph: fx.Graph) -> tuple[Callable, fx.GraphModule, list]:
    """(program, module, views): the trace's numpy graph as a GraphModule, its code run over a plain
    namespace of its constants, and (holder, name, constants, key, make) per tensor viewed."""
    numpy = NumpyGraph(root)
    for node in graph.nodes:
        numpy.add(node)
    module = fx.GraphModule(numpy.constants, numpy.graph)
    constants = types.SimpleNamespace(**numpy.constants)
    program = types.MethodType(type(module).forward, constants)
    views = [(holder, name, constants, key, make) for holder, name, key, make in numpy.views]
    return program, module, views


def with_modes(graph: fx.Graph) -> fx.Graph:
    """A copy of the trace in which each sample is its distribution's mode (evaluation's)."""
    copied = copy.deepcopy(graph)
    for node in copied.nodes:
        if node.op == "call_method" and node.target in ("sample", "rsample"):
            node.op = "call_function"
            node.target = getattr
            node.args = (node.args[0], "mode")
    return copied


def describe(node: fx.Node, root: nn.Module, objects: dict) -> str:
    """What a node of the trace calls, as a line names it."""
    if node.op == "call_module":
        module = root.get_submodule(node.target)
        return f"the layer {type(module).__name__} ({node.target.removeprefix('agent.')})"
    if node.op == "call_method":
        receiver = objects.get(node.args[0])
        if receiver is None:
            return f"the tensor method .{node.target}()"
        return f"the method {receiver}.{node.target}()"
    target = node.target
    if target is getattr:
        return f"the attribute {objects.get(node.args[0], 'tensor')}.{node.args[1]}"
    if isinstance(target, type) and issubclass(target, D.Distribution):
        return f"the distribution {target.__name__}"
    if isinstance(target, type) and issubclass(target, D.Transform):
        return f"the transform {target.__name__}"
    name = getattr(target, "__name__", str(target))
    module = getattr(target, "__module__", None)
    if module == "_operator":
        return f"the operator {name}"
    return f"the function {module}.{name}" if module else f"the function {name}"


def failed(what: str, error: Exception) -> str:
    """The line for a numpy version of `what` that raised `error`."""
    said = f"{type(error).__name__}: {failures.first_line(error)}"
    return f"the numpy version of {what} failed ({said})"


def holder_of(module: nn.Module, name: str, tensor: torch.Tensor) -> dict:
    """The dict in which `module` holds `tensor` as `name` (a later one is found there), or one."""
    places = (module._parameters, module._buffers, vars(module))
    return next((place for place in places if name in place), {name: tensor})


def numpy_transform(transform: D.Transform) -> NumpyTransform | None:
    """The numpy version of a torch transform built of constants (its tensors viewed), or None."""
    if type(transform) not in TRANSFORMS:
        return None
    build, names = TRANSFORMS[type(transform)]
    arguments = [as_numpy(getattr(transform, name)) for name in names]
    if holds(arguments, type(None)):  # a part without a numpy version
        return None
    return build(*arguments)


def as_numpy(value):
    """A transform's argument as its numpy version takes it (None where a part has none)."""
    if torch.is_tensor(value):
        return value.detach().cpu().numpy()
    if isinstance(value, D.Transform):
        return numpy_transform(value)
    if isinstance(value, list | tuple):
        return [as_numpy(item) for item in value]
    return value


def transform_tensors(transform: D.Transform) -> list[tuple[dict, str]]:
    """(holder, name) of each tensor a torch transform or its parts hold, for its numpy version."""
    found = []
    for name in TRANSFORMS[type(transform)][1]:
        value = getattr(transform, name)
        for item in value if isinstance(value, list | tuple) else [value]:
            if torch.is_tensor(item):
                found.append((vars(transform) if name in vars(transform) else {name: item}, name))
            elif isinstance(item, D.Transform):
                found += transform_tensors(item)
    return found


def holds(value, kinds: type | types.UnionType) -> bool:
    """Whether `value` is, or a list, tuple or dict of it holds, an instance of `kinds`."""
    if isinstance(value, kinds):
        return True
    if isinstance(value, tuple | list):
        return any(holds(item, kinds) for item in value)
    if isinstance(value, dict):
        return any(holds(item, kinds) for item in value.values())
    return False


class NumpyGraph:
    """The numpy version of a trace, built node by node; a value the code cannot write out is a
    constant, and `views` says which of the Agent's tensors a constant is made from."""

    def __init__(self, root: nn.Module):
        self.root = root
        self.graph = fx.Graph()
        self.nodes = {}  # the trace's node: its numpy version
        self.constants = {}
        self.views = []  # (holder, name, key, make): make() makes constant `key` of holder[name]
        self.built = set()  # nodes that build a distribution or transform (their methods called)
        self.objects = {}  # those, and what they reach through attributes, named for messages

    def add(self, node: fx.Node) -> None:
        """The numpy version of `node`, carrying in `meta["what"]` what the trace's node calls."""
        if node.op in ("placeholder", "output"):
            self.nodes[node] = self.graph.node_copy(node, self.nodes.__getitem__)
            return
        what = describe(node, self.root, self.objects)
        try:
            args = fx.node.map_aggregate(node.args, self.argument)
            kwargs = fx.node.map_aggregate(node.kwargs, self.argument)
            added = getattr(self, node.op)(node, what, args, kwargs)
        except NoNumpyVersion:
            raise
        except Exception as error:  # a numpy version that cannot take these arguments
            raise NoNumpyVersion(failed(what, error)) from error
        added.meta["what"] = what
        self.nodes[node] = added
        self.remember(node)

    def get_attr(self, node: fx.Node, what: str, args: tuple, kwargs: dict) -> fx.Node:
        """A tensor the Agent holds, as a numpy view made anew where another is put in its place."""
        path, _, attribute = node.target.rpartition(".")
        owner = self.root.get_submodule(path)
        holder = holder_of(owner, attribute, getattr(owner, attribute))
        make = functools.partial(view_of, holder, attribute)
        return self.graph.get_attr(self.viewed(make(), make, [(holder, attribute)]))

    def call_module(self, node: fx.Node, what: str, args: tuple, kwargs: dict) -> fx.Node:
        """A call of one of the Agent's layers: its numpy version over views of its parameters."""
        module = self.root.get_submodule(node.target)
        if (layer := numpy_layer(module)) is None:
            raise no_numpy_version(what, type(module))
        held = [(module._parameters, name) for name in layer_parameters(module)]
        layer = self.viewed(layer, functools.partial(numpy_layer, module), held)
        return self.call(node, layer, args, kwargs)

    def call_function(self, node: fx.Node, what: str, args: tuple, kwargs: dict) -> fx.Node:
        """A call of a function, distribution or transform: its numpy version, or the operator."""
        target = (
            DISTRIBUTIONS.get(node.target)
            or TRANSFORMS.get(node.target, (None,))[0]
            or FUNCTIONS.get(node.target)
        )
        if target is None:
            raise no_numpy_version(what, node.target)
        if target is node.target:
            return self.graph.create_node("call_function", target, args, kwargs, node.name)
        return self.call(node, self.constant(target), args, kwargs)

    def call_method(self, node: fx.Node, what: str, args: tuple, kwargs: dict) -> fx.Node:
        """A method called on a tensor or a built object: numpy's method, or a function of it."""
        method = node.target
        receiver = node.args[0]
        if receiver not in self.built and method in SAME_IN_NUMPY and not kwargs:
            method = SAME_IN_NUMPY[method]  # numpy's method takes torch's arguments
        elif receiver not in self.built and method in METHODS:
            return self.call(node, self.constant(METHODS[method]), args, kwargs)
        elif receiver not in self.objects:  # a distribution's attribute: one, or an array
            raise no_numpy_version(what, f".{method}()")
        return self.graph.create_node("call_method", method, args, kwargs, node.name)

    def call(self, node: fx.Node, key: str, args: tuple, kwargs: dict) -> fx.Node:
        """A call of the constant `key` in place of `node`, as of a layer the program holds."""
        return self.graph.create_node("call_module", key, args, kwargs, node.name)

    def remember(self, node: fx.Node) -> None:
        """What `node` builds, or reaches through an attribute, named for the messages."""
        target = node.target
        if node.op == "call_function" and isinstance(target, type) and issubclass(target, RECORDED):
            self.built.add(node)
            self.objects[node] = target.__name__
        elif node.op == "call_function" and target is getattr and node.args[0] in self.objects:
            self.objects[node] = f"{self.objects[node.args[0]]}.{node.args[1]}"

    def argument(self, value):
        """An argument as the program takes it: a node's numpy version, a literal, or a constant."""
        if isinstance(value, fx.Node):
            return self.nodes[value]
        if type(value) in LITERALS:
            return value
        if isinstance(value, torch.dtype):
            if value not in DTYPES:
                raise no_numpy_version(f"the dtype {value}", value)
            return self.graph.get_attr(self.constant(DTYPES[value]))
        if isinstance(value, D.Transform):
            if (transform := numpy_transform(value)) is None:
                raise no_numpy_version(f"the transform {type(value).__name__}", type(value))
            make = functools.partial(numpy_transform, value)
            return self.graph.get_attr(self.viewed(transform, make, transform_tensors(value)))
        return self.graph.get_attr(self.constant(value))

    def viewed(self, value, make: Callable[[], object], held: list[tuple[dict, str]]) -> str:
        """The constant `value`, which `make` makes from the tensors `holder[name]` in `held`."""
        key = self.constant(value)
        self.views.extend((holder, name, key, make) for holder, name in held)
        return key

    def constant(self, value) -> str:
        """The name of a new constant of the program, `value`."""
        key = f"k{len(self.constants)}"
        self.constants[key] = value
        return key


class Trial(fx.Interpreter):
    """A numpy program run node by node, once, where the rollout is derived: a numpy version that
    fails is named by what its node calls."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.extra_traceback = False  # the message is the node's, as it is

    def run_node(self, node: fx.Node):
        try:
            return super().run_node(node)
        except NoNumpyVersion:
            raise
        except Exception as error:
            if "what" not in node.meta:
                raise
            attribute = node.args[1] if node.target is getattr else node.target
            if isinstance(error, AttributeError) and error.name == attribute:
                raise no_numpy_version(node.meta["what"], None) from error
            raise NoNumpyVersion(failed(node.meta["what"], error)) from error
