"""The rollout's view of the Agent, derived from it and checked against it: the Agent's
`get_action_and_value(x)` and `get_value(x)`, traced once with torch.fx, run on numpy rows. At one
observation per env, torch's per-call overhead costs more than the arithmetic, so the MLP scripts
act through numpy versions of the Agent's own layers, functions and torch.distributions (Normal,
Categorical, Beta, a tanh-squashed or affine-transformed Normal, Independent). Where the trace meets
something with no numpy version, the rollout runs the Agent's own torch code instead (slower), and
says so in one line. Either way `check` compares what the rollout recorded with the Agent's own
numbers."""

import functools
import math
import operator
import types
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.distributions as D
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ddrl import checks, failures

# observations of the probe at start, and rows of each batch checked against the Agent
PROBE_SAMPLES = 256
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# kept: tracing replaces the names of their subclasses for a while
RECORDED = (D.Distribution, D.Transform)
# the place of the entropy among get_action_and_value's results: a rollout never needs it
ENTROPY = 2
# the file name of a derived program, by which a failure in it is traced to the line that failed
PROGRAM_FILE = "<the Agent's method, derived by ddrl.rollout>"
# the address of a tensor's memory: what a numpy view of it reads
DATA_PTR = torch.Tensor.data_ptr
SAME_IN_NUMPY = {  # tensor methods a numpy array has, and their names in numpy
    "sum": "sum",
    "mean": "mean",
    "view": "reshape",
    "reshape": "reshape",
    "argmax": "argmax",
}
DTYPES = {  # torch's dtypes an Agent names, and numpy's
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.long: np.int64,
}
log_gamma = np.vectorize(math.lgamma, otypes=[np.float64])
INSTEAD = {  # constructs without a numpy version, and what to write instead
    D.MultivariateNormal: (
        "with a diagonal covariance, Independent(Normal(loc, scale), 1) is the same distribution "
        "and has one"
    ),
    nn.GELU: 'nn.GELU(approximate="tanh"), its tanh approximation, has one',
    F.gelu: 'F.gelu(x, approximate="tanh"), its tanh approximation, has one',
    ".max()": ".amax(dim) has one (the maxima alone)",
    ".min()": ".amin(dim) has one (the minima alone)",
}
# agent: its traced methods, or why the rollout runs its torch code
DERIVED = weakref.WeakKeyDictionary()
# agent: the programs derived from it, which check() has look again for replaced tensors
PROGRAMS = weakref.WeakKeyDictionary()


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
    """torch.fx's tracer, keeping distributions and transforms built of constants in the graph as
    they are, and buffers (statistics that change as the run goes) as references, never as the
    values they had when traced."""

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


class NumpyNormal:
    """torch.distributions.Normal on numpy arrays, drawing from numpy's seeded generator."""

    event_dims = 0  # its event is one number

    def __init__(self, loc, scale, validate_args=None):
        self.loc = loc
        self.scale = scale
        # the last sample and its standard normal noise: its log-probability needs no division
        self.drawn = None

    def sample(self, sample_shape=()):
        shape = (
            self.loc.shape
            if self.loc.shape == self.scale.shape
            else np.broadcast(self.loc, self.scale).shape
        )
        noise = np.random.standard_normal((*sample_shape, *shape)).astype(self.loc.dtype)
        value = self.loc + self.scale * noise
        self.drawn = (value, noise)
        return value

    rsample = sample

    def log_prob(self, value):
        noise = (
            self.drawn[1]
            if self.drawn is not None and value is self.drawn[0]
            else (value - self.loc) / self.scale
        )
        return -0.5 * noise**2 - np.log(self.scale) - LOG_SQRT_2PI

    def entropy(self):
        return 0.5 + LOG_SQRT_2PI + np.log(self.scale)

    @property
    def mode(self):
        return self.loc

    mean = mode

    @property
    def stddev(self):
        return self.scale

    @property
    def variance(self):
        return self.scale**2


class NumpyCategorical:
    """torch.distributions.Categorical on numpy arrays: sampled by inverse CDF from numpy's seeded
    generator."""

    event_dims = 0  # its event is one number

    def __init__(self, probs=None, logits=None, validate_args=None):
        self.logits = (
            log_softmax(logits)
            if logits is not None
            else np.log(probs / probs.sum(-1, keepdims=True))
        )

    def sample(self, sample_shape=()):
        uniform = np.random.random_sample((*sample_shape, *self.logits.shape[:-1], 1))
        below = (np.exp(self.logits).cumsum(-1) < uniform).sum(-1)
        return np.minimum(below, self.logits.shape[-1] - 1)

    def log_prob(self, value):
        return np.take_along_axis(self.logits, value[..., None].astype(np.int64), -1)[..., 0]

    def entropy(self):
        return -(np.exp(self.logits) * self.logits).sum(-1)

    @property
    def mode(self):
        return self.logits.argmax(-1)

    @property
    def probs(self):
        return np.exp(self.logits)


class NumpyBeta:
    """torch.distributions.Beta on numpy arrays, drawing from numpy's seeded generator."""

    event_dims = 0  # its event is one number

    def __init__(self, concentration1, concentration0, validate_args=None):
        self.alpha, self.beta = np.broadcast_arrays(concentration1, concentration0)

    def sample(self, sample_shape=()):
        shape = (*sample_shape, *self.alpha.shape)
        return np.random.beta(self.alpha, self.beta, shape).astype(self.alpha.dtype)

    rsample = sample

    def log_prob(self, value):
        a = self.alpha.astype(np.float64)
        b = self.beta.astype(np.float64)
        normaliser = log_gamma(a) + log_gamma(b) - log_gamma(a + b)
        return ((a - 1) * np.log(value) + (b - 1) * np.log1p(-value) - normaliser).astype(
            self.alpha.dtype
        )

    @property
    def mean(self):
        return self.alpha / (self.alpha + self.beta)

    @property
    def mode(self):
        return (self.alpha - 1) / (self.alpha + self.beta - 2)


class NumpyIndependent:
    """torch.distributions.Independent on numpy arrays: the last dims summed into one event."""

    def __init__(self, base_distribution, reinterpreted_batch_ndims, validate_args=None):
        self.base_dist = base_distribution
        self.axes = tuple(range(-reinterpreted_batch_ndims, 0))
        self.event_dims = base_distribution.event_dims + reinterpreted_batch_ndims

    def sample(self, sample_shape=()):
        return self.base_dist.sample(sample_shape)

    rsample = sample

    def log_prob(self, value):
        return self.base_dist.log_prob(value).sum(self.axes)

    def entropy(self):
        return self.base_dist.entropy().sum(self.axes)

    @property
    def mode(self):
        return self.base_dist.mode

    @property
    def mean(self):
        return self.base_dist.mean


class NumpyTransform:
    """A torch.distributions transform on numpy arrays: forward, inverse, log |det J|
    (log_abs_det_jacobian), summed over its last `event_dim` dims."""

    def __init__(self, forward, inverse, log_abs_det_jacobian, event_dim: int = 0):
        self.forward = forward
        self.inverse = inverse
        self.log_abs_det_jacobian = log_abs_det_jacobian
        self.event_dim = event_dim

    def __call__(self, x):
        return self.forward(x)

    @property
    def inv(self) -> "NumpyTransform":
        jacobian = self.log_abs_det_jacobian
        return NumpyTransform(
            self.inverse, self.forward, lambda y, x: -jacobian(x, y), self.event_dim
        )


class NumpyTransformed:
    """torch.distributions.TransformedDistribution on numpy arrays, its log-probability summed over
    the dims of its event as torch sums it."""

    def __init__(self, base_distribution, transforms, validate_args=None):
        self.base_dist = base_distribution
        self.transforms = transforms if isinstance(transforms, list) else [transforms]
        domain_dims = max([transform.event_dim for transform in self.transforms], default=0)
        self.event_dims = max(base_distribution.event_dims, domain_dims)

    def sample(self, sample_shape=()):
        x = self.base_dist.sample(sample_shape)
        for transform in self.transforms:
            x = transform.forward(x)
        return x

    rsample = sample

    def log_prob(self, value):
        log_prob = 0.0
        y = value
        for transform in reversed(self.transforms):
            x = transform.inverse(y)
            jacobian = transform.log_abs_det_jacobian(x, y)
            log_prob = log_prob - sum_rightmost(jacobian, self.event_dims - transform.event_dim)
            y = x
        base = self.base_dist.log_prob(y)
        return log_prob + sum_rightmost(base, self.event_dims - self.base_dist.event_dims)


class NoNumpyVersion(Exception):
    """Something the Agent's method does that ddrl has no numpy version of, said in full: what it
    is, and what to write instead where there is an alternative."""


class ProgramText:
    """A derived program as `program` writes it, one line per node of the trace: its lines, the
    namespace of constants they name, and the views those constants are made from. Numpy versions
    (`to_numpy`) or the torch ones themselves; with `deterministic`, a sample is its distribution's
    mode."""

    def __init__(self, root: nn.Module, to_numpy: bool, deterministic: bool):
        self.root = root
        self.to_numpy = to_numpy
        self.deterministic = deterministic
        self.namespace = {}
        self.views = []
        self.names = {}  # node: the name its line assigns, or the constant it is
        self.lines = ["def method(x):"]
        # the nodes that build a distribution or transform, whose methods are called on it
        # directly; and those, with what they reach through attributes, named for the lines
        self.built = set()
        self.objects = {}

    def write(self, node: fx.Node) -> None:
        """The line of `node` (the observations, or a call), or the constant it is (a tensor the
        Agent holds)."""
        name = f"v{len(self.names)}"
        self.names[node] = name
        if node.op == "placeholder":
            self.lines.append(f"    {name} = x")
        elif node.op == "get_attr":
            self.names[node] = self.get_attr(node.target)
        else:
            self.lines.append(self.call(node, name))
            self.remember(node)

    def write_return(self, results) -> None:
        """The last line: the method's results, the entropy of get_action_and_value as None."""
        if not isinstance(results, tuple):
            self.lines.append(f"    return {self.render(results)}")
            return
        returned = [
            "None" if place == ENTROPY else self.render(result)
            for place, result in enumerate(results)
        ]
        self.lines.append(f"    return ({', '.join(returned)},)")

    def get_attr(self, target: str) -> str:
        """The constant for the tensor the Agent holds at `target`: a numpy view of it, or the
        tensor, made anew from its holder where another is put in its place."""
        path, _, attribute = target.rpartition(".")
        owner = self.root.get_submodule(path)
        holder = holder_of(owner, attribute, getattr(owner, attribute))
        make = functools.partial(view_of if self.to_numpy else operator.getitem, holder, attribute)
        return self.viewed(make(), make, [(holder, attribute)])

    def call(self, node: fx.Node, name: str) -> str:
        """The line of a node that calls something: `name` assigned what it returns, and a comment
        naming what it calls, which also names what fails to have a numpy version."""
        what = describe(node, self.root, self.objects)
        try:
            return f"    {name} = {self.statement(node, what)}  # {what}"
        except NoNumpyVersion:
            raise
        except Exception as error:  # a numpy version that cannot take these arguments
            raise NoNumpyVersion(failed(what, error)) from error

    def remember(self, node: fx.Node) -> None:
        """The distribution or transform `node` builds, or one it reaches through an attribute,
        named for the lines that call its methods."""
        target = node.target
        if node.op == "call_function" and isinstance(target, type) and issubclass(target, RECORDED):
            self.built.add(node)
            self.objects[node] = target.__name__
        elif node.op == "call_function" and target is getattr and node.args[0] in self.objects:
            self.objects[node] = f"{self.objects[node.args[0]]}.{node.args[1]}"

    def statement(self, node: fx.Node, what: str) -> str:
        """The right-hand side of `node`'s line: what it calls, on what."""
        args = [self.render(arg) for arg in node.args] + [
            f"{key}={self.render(value)}" for key, value in node.kwargs.items()
        ]
        if node.op == "call_module":
            return self.module_call(node, what, args)
        if node.op == "call_function":
            return self.function_call(node, what, args)
        return self.method_call(node, what, args)

    def module_call(self, node: fx.Node, what: str, args: list[str]) -> str:
        """A call of one of the Agent's layers: its numpy version over views of its parameters, or
        the layer."""
        module = self.root.get_submodule(node.target)
        if not self.to_numpy:
            return f"{self.constant(module)}({', '.join(args)})"
        if (layer := numpy_layer(module)) is None:
            raise no_numpy_version(what, type(module))
        held = [(module._parameters, name) for name in layer_parameters(module)]
        key = self.viewed(layer, functools.partial(numpy_layer, module), held)
        return f"{key}({', '.join(args)})"

    def function_call(self, node: fx.Node, what: str, args: list[str]) -> str:
        """A call of a function, or of a distribution or transform class: its numpy version, or
        itself."""
        target = node.target
        if self.to_numpy:
            target = (
                DISTRIBUTIONS.get(target)
                or TRANSFORMS.get(target, (None,))[0]
                or FUNCTIONS.get(target)
            )
            if target is None:
                raise no_numpy_version(what, node.target)
        return f"{self.constant(target)}({', '.join(args)})"

    def method_call(self, node: fx.Node, what: str, args: list[str]) -> str:
        """A method called on a tensor, on a distribution or transform, or on what one of those
        reaches through an attribute: in numpy, numpy's method or a function of the array."""
        receiver, *rest = args
        if self.deterministic and node.target in ("sample", "rsample"):
            return f"{receiver}.mode"
        if node.args[0] in self.built or not self.to_numpy:
            return f"{receiver}.{node.target}({', '.join(rest)})"
        if node.target in SAME_IN_NUMPY and not node.kwargs:  # numpy's method takes torch's args
            return f"{receiver}.{SAME_IN_NUMPY[node.target]}({', '.join(rest)})"
        if node.target in METHODS:
            return f"{self.constant(METHODS[node.target])}({', '.join(args)})"
        if node.args[0] in self.objects:  # a distribution's attribute: a distribution, or an array
            return f"{receiver}.{node.target}({', '.join(rest)})"
        raise no_numpy_version(what, f".{node.target}()")

    def render(self, arg) -> str:
        """An argument as the source writes it: a node's name, a container of what it holds, a
        literal, or a constant."""
        if isinstance(arg, fx.Node):
            return self.names[arg]
        if isinstance(arg, tuple | list):
            inside = ", ".join(self.render(item) for item in arg)
            return f"({inside},)" if isinstance(arg, tuple) else f"[{inside}]"
        if isinstance(arg, dict):
            inside = ", ".join(f"{key!r}: {self.render(item)}" for key, item in arg.items())
            return "{" + inside + "}"
        if isinstance(arg, slice):
            inside = ", ".join(self.render(part) for part in (arg.start, arg.stop, arg.step))
            return f"slice({inside})"
        if arg is None or isinstance(arg, bool | int | str):
            return repr(arg)
        if isinstance(arg, float) and math.isfinite(arg):
            return repr(arg)
        return self.constant_of(arg)

    def constant_of(self, arg) -> str:
        """The constant for an argument the source cannot write out: in numpy, a dtype as numpy's,
        a transform as its numpy version over views of its tensors."""
        if self.to_numpy and isinstance(arg, torch.dtype):
            if arg not in DTYPES:
                raise no_numpy_version(f"the dtype {arg}", arg)
            return self.constant(DTYPES[arg])
        if self.to_numpy and isinstance(arg, D.Transform):
            if (transform := numpy_transform(arg)) is None:
                raise no_numpy_version(f"the transform {type(arg).__name__}", type(arg))
            make = functools.partial(numpy_transform, arg)
            return self.viewed(transform, make, transform_tensors(arg))
        return self.constant(arg)

    def viewed(self, value, make: Callable[[], object], held: list[tuple[dict, str]]) -> str:
        """The constant `value`, which `make` makes from the tensors `holder[name]` in `held`."""
        key = self.constant(value)
        self.views.extend((holder, name, key, make) for holder, name in held)
        return key

    def constant(self, value) -> str:
        """The name of a new constant of the namespace, `value`."""
        key = f"k{len(self.namespace)}"
        self.namespace[key] = value
        return key


class Program:
    """A derived program, called on the rollout's rows: `program`'s function over constants made
    from the Agent's tensors, which follow every change made in place. Once check() has seen a
    rollout's batch (the update may follow), the next call first compares the memory of the tensors
    the Agent holds with the memory viewed, and makes those constants anew where one was put in
    another's place (a buffer assigned, `param.data = ...`): once per rollout, not per step."""

    def __init__(self, source: str, namespace: dict, views: list[tuple]):
        self.method = compiled(source, namespace)
        self.views = views
        self.holders = [holder for holder, _, _, _ in views]
        self.names = [name for _, name, _, _ in views]
        self.addresses = self.held()
        self.look_again = False

    def held(self) -> list[int] | None:
        """The address of each viewed tensor's memory, as the Agent holds it now; None where one is
        gone."""
        try:
            return list(map(DATA_PTR, map(dict.get, self.holders, self.names)))
        except TypeError:  # None in a tensor's place
            return None

    def view_again(self) -> None:
        """Every constant made from the Agent's tensors made anew, from those it holds now."""
        for key, make in {key: make for _, _, key, make in self.views}.items():
            self.method.__globals__[key] = make()
        self.addresses = self.held()

    def __call__(self, x):
        if self.look_again:
            self.look_again = False
            if self.held() != self.addresses:
                self.view_again()
        return self.method(x)


class NumpyAgent:
    """The Agent's get_action_and_value and get_value as numpy programs over views of its
    parameters and buffers, which see the weights as they are at each call. Takes and returns numpy
    arrays; the entropy is never computed (None)."""

    kind = "numpy versions of the Agent's methods"

    def __init__(self, act: Program, value: Program):
        self.get_action_and_value = act
        self.get_value = value


class TorchAgent:
    """The Agent's own get_action_and_value and get_value under inference mode, on tensors made from
    numpy rows; with `act`, that program (the traced method with each distribution's mode for its
    sample) instead."""

    kind = "the Agent's own torch code"

    def __init__(self, agent: nn.Module, act: Program | None = None):
        self.agent = agent
        self.act = act or agent.get_action_and_value
        self.device = next(agent.parameters()).device

    @torch.inference_mode()
    def get_action_and_value(self, x: np.ndarray) -> tuple:
        found = self.act(in_agents_dtype(self.agent, torch.as_tensor(x, device=self.device)))
        return tuple(None if item is None else item.cpu().numpy() for item in found)

    @torch.inference_mode()
    def get_value(self, x: np.ndarray) -> np.ndarray:
        x = in_agents_dtype(self.agent, torch.as_tensor(x, device=self.device))
        return self.agent.get_value(x).cpu().numpy()


# --- the rollout's Agent --------------------------------------------------------------------------
def derive(
    agent: nn.Module, observation_space, numpy_layers: bool = True, deterministic: bool = False
) -> NumpyAgent | TorchAgent:
    """The rollout's Agent: numpy programs derived from its methods, or (without `numpy_layers`, on
    a GPU, or where something in them has no numpy version) its own torch code. With
    `deterministic`, actions are each distribution's mode (evaluation). Derived once, before the
    loop: the programs read the parameters and buffers through numpy views that share their memory,
    so they follow every in-place change (an optimizer step, copy_, load_state_dict, a broadcast);
    a tensor the Agent replaces rather than changes is found by its address at the first call after
    check() saw a batch, and viewed anew (Program)."""
    example = example_observations(observation_space, 1)
    on_cpu = next(agent.parameters()).device.type == "cpu"
    methods = traced(agent, example, numpy_layers and on_cpu)
    if numpy_layers and on_cpu and "reason" not in methods:
        derived = numpy_agent(methods, deterministic)
        PROGRAMS[agent] = [derived.get_action_and_value, derived.get_value]
        if not deterministic or not mode_problem(derived, example):
            return derived
    if not deterministic:
        return TorchAgent(agent)
    needs = "--eval-deterministic needs the mode of the Agent's distribution, and"
    if "reason" in methods and "get_value" not in methods:
        failures.fail(f"{needs} {methods['reason']}")
    act = Program(*program(*methods["get_action_and_value"], False, True))
    PROGRAMS[agent] = [act]
    derived = TorchAgent(agent, act)
    if problem := mode_problem(derived, example):
        failures.fail(f"{needs} {problem}: evaluate without --eval-deterministic")
    return derived


def mode_problem(derived: NumpyAgent | TorchAgent, example: np.ndarray) -> str:
    """Why the deterministic rollout cannot act on `example` ('' if it can): a distribution without
    a mode (a TransformedDistribution, say), found before an episode begins."""
    try:
        derived.get_action_and_value(example)
    except Exception as error:
        return f"{type(error).__name__}: {failures.first_line(error)}"
    return ""


def traced(agent: nn.Module, example: np.ndarray, numpy_layers: bool) -> dict:
    """The Agent's two methods traced, and whether their numpy versions run on `example`
    observations: found once per Agent (its code does not change during a run); the slower path is
    said then, in one line (rank 0)."""
    if agent in DERIVED:
        return DERIVED[agent]
    found = {}
    try:
        found = {method: trace(agent, method) for method in ("get_action_and_value", "get_value")}
    except Exception as error:  # data-dependent control flow, a call torch.fx cannot follow
        said = f"{type(error).__name__}: {failures.first_line(error)}"
        found["reason"] = f"torch.fx cannot trace it ({said})"
    if numpy_layers and "reason" not in found:
        state = np.random.get_state()  # the trial's draws leave the rank's stream as it was
        try:
            trial = numpy_agent(found)
            trial.get_action_and_value(example)
            trial.get_value(example)
        except NoNumpyVersion as error:
            found["reason"] = str(error)
        except Exception as error:
            found["reason"] = failed_in_program(error)
        finally:
            np.random.set_state(state)
    if numpy_layers and "reason" in found and failures.this_rank() == 0:
        failures.tell(
            f"the rollout runs the Agent's own torch code, the slower path: {found['reason']}"
        )
    DERIVED[agent] = found
    return found


def numpy_agent(methods: dict, deterministic: bool = False) -> NumpyAgent:
    """The numpy programs of the traced methods, over views of the Agent's parameters and
    buffers."""
    act = Program(*program(*methods["get_action_and_value"], True, deterministic))
    value = Program(*program(*methods["get_value"], True))
    return NumpyAgent(act, value)


# --- tracing the Agent ----------------------------------------------------------------------------
def trace(agent: nn.Module, method: str) -> tuple[AgentMethod, fx.Graph]:
    """`agent.method(x)` (get_value, or get_action_and_value with action=None) as a torch.fx graph.
    A distribution or transform the Agent builds from tensors (traced values, its buffers and
    parameters) becomes one node, its class the node's target (its methods, nodes of their own), so
    that every tensor it holds is an input in the graph."""
    tracer = DistributionTracer()
    # how many real distributions and transforms are being built: torch's own code inside their
    # constructors builds its parts for real
    building = [0]

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
    return root, graph


def distribution_namespaces(agent: nn.Module) -> list[dict]:
    """The namespaces where the Agent's code may find a distribution or transform class: the globals
    of its modules' methods (a script's, whatever name it was imported under), torch.distributions
    and its submodules."""
    namespaces = {}
    for module in agent.modules():
        for cls in type(module).__mro__:
            for value in vars(cls).values():
                if isinstance(value, types.FunctionType):
                    namespaces[id(value.__globals__)] = value.__globals__
    modules = [D, *(value for value in vars(D).values() if isinstance(value, types.ModuleType))]
    return [*namespaces.values(), *(vars(module) for module in modules)]


# --- numpy versions of what an Agent calls --------------------------------------------------------
def softmax(x, dim=-1, dtype=None):
    shifted = np.exp(x - x.max(dim, keepdims=True))
    return shifted / shifted.sum(dim, keepdims=True)


def log_softmax(x, dim=-1, dtype=None):
    shifted = x - x.max(dim, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(dim, keepdims=True))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x, beta=1.0, threshold=20.0):
    return np.logaddexp(0, beta * x) / beta


def clamp(x, min=None, max=None):  # noqa: A002 (torch's names)
    return np.clip(x, min, max)


def reshape(x, *shape):
    return x.reshape(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape)


def expand(x, *sizes):
    sizes = sizes[0] if len(sizes) == 1 and isinstance(sizes[0], tuple | list) else sizes
    leading = len(sizes) - x.ndim
    shape = [x.shape[i - leading] if size == -1 else size for i, size in enumerate(sizes)]
    return np.broadcast_to(x, shape)


def flatten(x, start_dim=0, end_dim=-1):
    end = end_dim % x.ndim
    return x.reshape(*x.shape[:start_dim], -1, *x.shape[end + 1 :])


def squeeze(x, dim=None):
    if dim is None:
        return x.squeeze()
    return x.squeeze(dim) if x.shape[dim] == 1 else x


def cast(x, *args, **kwargs):
    """Tensor.to(...): a dtype converts, a device stays where numpy is."""
    wanted = kwargs.get(
        "dtype", next((arg for arg in args if isinstance(arg, np.dtype | type)), None)
    )
    return x if wanted is None else x.astype(wanted)


def gelu(x, approximate="none"):
    """torch's GELU where it is its tanh approximation: numpy has no erf for the exact one."""
    if approximate != "tanh":
        raise no_numpy_version("the function torch.nn.functional.gelu", F.gelu)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def split(x, size, dim=0):
    return np.split(x, range(size, x.shape[dim], size), axis=dim)


FUNCTIONS = {  # torch's functions an Agent calls, and their numpy versions
    torch.exp: np.exp,
    torch.log: np.log,
    torch.tanh: np.tanh,
    torch.sigmoid: sigmoid,
    torch.sqrt: np.sqrt,
    torch.abs: np.abs,
    torch.square: np.square,
    torch.clamp: clamp,
    torch.clip: clamp,
    torch.relu: lambda x: np.maximum(x, 0),
    torch.cat: lambda tensors, dim=0: np.concatenate(tensors, axis=dim),
    torch.stack: lambda tensors, dim=0: np.stack(tensors, axis=dim),
    torch.softmax: softmax,
    torch.log_softmax: log_softmax,
    torch.where: np.where,
    torch.minimum: np.minimum,
    torch.maximum: np.maximum,
    torch.atanh: np.arctanh,
    torch.log1p: np.log1p,
    torch.zeros_like: lambda x, **_: np.zeros_like(x),
    torch.ones_like: lambda x, **_: np.ones_like(x),
    F.relu: lambda x, inplace=False: np.maximum(x, 0),
    F.tanh: np.tanh,
    F.sigmoid: sigmoid,
    F.softplus: softplus,
    F.softmax: softmax,
    F.log_softmax: log_softmax,
    F.silu: lambda x, inplace=False: x * sigmoid(x),
    F.gelu: gelu,
    F.hardtanh: lambda x, min_val=-1.0, max_val=1.0, inplace=False: np.clip(x, min_val, max_val),
    F.elu: lambda x, alpha=1.0, inplace=False: np.where(
        x > 0, x, alpha * np.expm1(np.minimum(x, 0))
    ),
    F.leaky_relu: lambda x, negative_slope=0.01, inplace=False: np.where(
        x > 0, x, negative_slope * x
    ),
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.truediv: operator.truediv,
    operator.neg: operator.neg,
    operator.pow: operator.pow,
    operator.matmul: operator.matmul,
    operator.getitem: operator.getitem,
    getattr: getattr,
}
METHODS = {  # tensor methods an Agent calls, as functions of a numpy array
    "expand_as": lambda x, other: (
        x if x.shape == other.shape else x + np.zeros(other.shape, x.dtype)
    ),
    "expand": expand,
    "sum": lambda x, dim=None, keepdim=False: x.sum(dim, keepdims=keepdim),
    "mean": lambda x, dim=None, keepdim=False: x.mean(dim, keepdims=keepdim),
    "view": reshape,
    "reshape": reshape,
    "flatten": flatten,
    "squeeze": squeeze,
    "unsqueeze": lambda x, dim: np.expand_dims(x, dim),
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "tanh": np.tanh,
    "atanh": np.arctanh,
    "sigmoid": sigmoid,
    "square": np.square,
    "add": lambda x, other, alpha=1: x + alpha * other,
    "sub": lambda x, other, alpha=1: x - alpha * other,
    "mul": operator.mul,
    "div": operator.truediv,
    "sqrt": np.sqrt,
    "abs": np.abs,
    "clamp": clamp,
    "clip": clamp,
    "clamp_min": lambda x, min: np.maximum(x, min),  # noqa: A006 (torch's name)
    "clamp_max": lambda x, max: np.minimum(x, max),  # noqa: A006 (torch's name)
    "pow": np.power,
    "neg": np.negative,
    "float": lambda x: x.astype(np.float32),
    "double": lambda x: x.astype(np.float64),
    "to": cast,
    "softmax": softmax,
    "log_softmax": log_softmax,
    "t": lambda x: x.T,
    "transpose": lambda x, a, b: np.swapaxes(x, a, b),
    "contiguous": lambda x: x,
    "detach": lambda x: x,
    "argmax": lambda x, dim=None, keepdim=False: x.argmax(dim, keepdims=keepdim),
    "amax": lambda x, dim=None, keepdim=False: x.max(dim, keepdims=keepdim),
    "amin": lambda x, dim=None, keepdim=False: x.min(dim, keepdims=keepdim),
    "chunk": np.array_split,
    "split": split,
    "size": lambda x, dim=None: x.shape if dim is None else x.shape[dim],
    "type_as": lambda x, other: x.astype(other.dtype),
}
ACTIVATIONS = {
    nn.Identity: lambda module: lambda x: x,
    nn.Tanh: lambda module: np.tanh,
    nn.ReLU: lambda module: lambda x: np.maximum(x, 0),
    nn.Sigmoid: lambda module: sigmoid,
    nn.SiLU: lambda module: lambda x: x * sigmoid(x),
    nn.ELU: lambda module: lambda x: np.where(x > 0, x, module.alpha * np.expm1(np.minimum(x, 0))),
    nn.LeakyReLU: lambda module: lambda x: np.where(x > 0, x, module.negative_slope * x),
    nn.Softplus: lambda module: lambda x: np.logaddexp(0, module.beta * x) / module.beta,
    nn.Hardtanh: lambda module: lambda x: np.clip(x, module.min_val, module.max_val),
    nn.Softmax: lambda module: lambda x: softmax(x, module.dim),
    nn.LogSoftmax: lambda module: lambda x: log_softmax(x, module.dim),
    nn.Flatten: lambda module: lambda x: flatten(x, module.start_dim, module.end_dim),
}


def tanh_transform(cache_size: int = 0) -> NumpyTransform:
    return NumpyTransform(
        np.tanh, np.arctanh, lambda x, y: 2.0 * (math.log(2.0) - x - softplus(-2.0 * x))
    )


def exp_transform(cache_size: int = 0) -> NumpyTransform:
    return NumpyTransform(np.exp, np.log, lambda x, y: x)


def sigmoid_transform(cache_size: int = 0) -> NumpyTransform:
    return NumpyTransform(
        sigmoid, lambda y: np.log(y) - np.log1p(-y), lambda x, y: -softplus(-x) - softplus(x)
    )


def softplus_transform(cache_size: int = 0) -> NumpyTransform:
    return NumpyTransform(softplus, lambda y: y + np.log(-np.expm1(-y)), lambda x, y: -softplus(-x))


def affine_transform(loc, scale, event_dim: int = 0, cache_size: int = 0) -> NumpyTransform:
    """loc + scale * x; a Python number stays one, so that float32 rows stay float32. An array's
    log |scale| is taken at each call, from the view, never kept from when it was built."""
    number = isinstance(scale, int | float)

    def log_abs_det_jacobian(x, y):
        log_abs_scale = math.log(abs(scale)) if number else np.log(np.abs(scale))
        return sum_rightmost(np.broadcast_to(log_abs_scale, x.shape), event_dim)

    return NumpyTransform(
        lambda x: loc + scale * x, lambda y: (y - loc) / scale, log_abs_det_jacobian, event_dim
    )


def power_transform(exponent, cache_size: int = 0) -> NumpyTransform:
    return NumpyTransform(
        lambda x: x**exponent,
        lambda y: y ** (1 / exponent),
        lambda x, y: np.log(np.abs(exponent * y / x)),
    )


def independent_transform(
    base_transform: NumpyTransform, reinterpreted_batch_ndims: int, cache_size: int = 0
) -> NumpyTransform:
    base_jacobian = base_transform.log_abs_det_jacobian
    return NumpyTransform(
        base_transform.forward,
        base_transform.inverse,
        lambda x, y: sum_rightmost(base_jacobian(x, y), reinterpreted_batch_ndims),
        base_transform.event_dim + reinterpreted_batch_ndims,
    )


def compose_transform(parts: list, cache_size: int = 0) -> NumpyTransform:
    """The parts applied in order; log |det J|, each part's summed over the dims of the whole's
    event."""
    event_dim = max([part.event_dim for part in parts], default=0)

    def forward(x):
        for part in parts:
            x = part.forward(x)
        return x

    def inverse(y):
        for part in reversed(parts):
            y = part.inverse(y)
        return y

    def log_abs_det_jacobian(x, y):
        total = 0.0
        for part in parts:
            y = part.forward(x)
            total = total + sum_rightmost(
                part.log_abs_det_jacobian(x, y), event_dim - part.event_dim
            )
            x = y
        return total

    return NumpyTransform(forward, inverse, log_abs_det_jacobian, event_dim)


# torch's transforms, their numpy versions, and the attributes of a torch transform that are the
# numpy version's arguments
TRANSFORMS = {
    D.TanhTransform: (tanh_transform, ()),
    D.ExpTransform: (exp_transform, ()),
    D.SigmoidTransform: (sigmoid_transform, ()),
    D.SoftplusTransform: (softplus_transform, ()),
    D.AffineTransform: (affine_transform, ("loc", "scale", "event_dim")),
    D.PowerTransform: (power_transform, ("exponent",)),
    D.IndependentTransform: (
        independent_transform,
        ("base_transform", "reinterpreted_batch_ndims"),
    ),
    D.ComposeTransform: (compose_transform, ("parts",)),
}


def sum_rightmost(value, dims: int):
    """`value` summed over its last `dims` dims (torch.distributions' _sum_rightmost)."""
    if dims == 0:
        return value
    return value.reshape(*value.shape[: value.ndim - dims], -1).sum(-1)


def log_normal(loc, scale, validate_args=None) -> NumpyTransformed:
    """torch.distributions.LogNormal: a Normal under exp, as torch defines it."""
    return NumpyTransformed(NumpyNormal(loc, scale), [exp_transform()])


DISTRIBUTIONS = {
    D.Normal: NumpyNormal,
    D.Categorical: NumpyCategorical,
    D.Beta: NumpyBeta,
    D.Independent: NumpyIndependent,
    D.TransformedDistribution: NumpyTransformed,
    D.LogNormal: log_normal,
}


# --- a traced method as a Python function ---------------------------------------------------------
def program(
    root: nn.Module, graph: fx.Graph, to_numpy: bool, deterministic: bool = False
) -> tuple[str, dict, list[tuple]]:
    """The traced method as Python source, run over a namespace of what its nodes call: numpy
    versions (`to_numpy`), or the torch ones themselves; each line ends in a comment naming what
    it calls. The entropy of get_action_and_value is never computed; with `deterministic`, a
    distribution's `sample()` is its mode. Returns (source, namespace, views): `views` lists, for
    each tensor of the Agent a constant of the namespace is made from (a numpy view of it, a layer
    or transform over views, or in torch the tensor), (holder, name, key, make), `make()` making
    that constant anew from `holder[name]`."""
    results = list(graph.nodes)[-1].args[0]  # what the output node returns
    text = ProgramText(root, to_numpy, deterministic)
    for node in live_nodes(graph, results):
        text.write(node)
    text.write_return(results)
    return "\n".join(text.lines), text.namespace, text.views


def live_nodes(graph: fx.Graph, results) -> list[fx.Node]:
    """The nodes the method's results need (the entropy of get_action_and_value is not one), in
    the graph's order."""
    wanted = (
        [result for place, result in enumerate(results) if place != ENTROPY]
        if isinstance(results, tuple)
        else [results]
    )
    live = set()
    pending = [result for result in wanted if isinstance(result, fx.Node)]
    while pending:
        node = pending.pop()
        if node not in live:
            live.add(node)
            pending.extend(node.all_input_nodes)
    return [node for node in graph.nodes if node in live]


def numpy_layer(module: nn.Module):
    """A leaf module of the Agent as a function of numpy rows, over views of its parameters; None if
    it has none."""
    params = {name: view_of(module._parameters, name) for name in layer_parameters(module)}
    if type(module) is nn.Linear:
        weight = params["weight"].T
        bias = params.get("bias", 0.0)
        return lambda x: x @ weight + bias
    if type(module) is nn.LayerNorm and len(module.normalized_shape) == 1:
        weight = params.get("weight", 1.0)
        bias = params.get("bias", 0.0)
        eps = module.eps
        return lambda x: (
            (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * weight
            + bias
        )
    if type(module) in ACTIVATIONS:
        return ACTIVATIONS[type(module)](module)
    if type(module) is nn.GELU and module.approximate == "tanh":
        return lambda x: gelu(x, "tanh")
    return None


def view_of(holder: dict, name: str) -> np.ndarray:
    """A numpy view of the tensor `holder[name]`: it shares the tensor's memory (no copy, the same
    dtype), so it follows every change made in place."""
    return holder[name].detach().numpy()


def holder_of(module: nn.Module, name: str, tensor: torch.Tensor) -> dict:
    """The dict in which `module` holds `tensor` as `name` (its parameters, buffers or attributes),
    where a tensor put in its place is found; `{name: tensor}` where none does."""
    places = (module._parameters, module._buffers, vars(module))
    return next((place for place in places if name in place), {name: tensor})


def layer_parameters(module: nn.Module) -> list[str]:
    """The names of a layer's own parameters (not None: a Linear's missing bias is)."""
    return [name for name, value in module._parameters.items() if value is not None]


def as_numpy(value):
    """A transform's argument as its numpy version takes it: a tensor as a numpy view of it, a
    transform as its numpy version (None where it has none)."""
    if torch.is_tensor(value):
        return value.detach().cpu().numpy()
    if isinstance(value, D.Transform):
        return numpy_transform(value)
    if isinstance(value, list | tuple):
        return [as_numpy(item) for item in value]
    return value


def numpy_transform(transform: D.Transform) -> NumpyTransform | None:
    """The numpy version of a torch transform built of constants (its tensors are viewed, not
    copied), or None."""
    if type(transform) not in TRANSFORMS:
        return None
    build, names = TRANSFORMS[type(transform)]
    arguments = [as_numpy(getattr(transform, name)) for name in names]
    if holds(arguments, type(None)):  # a part without a numpy version
        return None
    return build(*arguments)


def holds(value, kinds: type | types.UnionType) -> bool:
    """Whether `value` is, or a list, tuple or dict of it holds, an instance of `kinds`."""
    if isinstance(value, kinds):
        return True
    if isinstance(value, tuple | list):
        return any(holds(item, kinds) for item in value)
    if isinstance(value, dict):
        return any(holds(item, kinds) for item in value.values())
    return False


def transform_tensors(transform: D.Transform) -> list[tuple[dict, str]]:
    """(holder, name) of each tensor that a torch transform built of constants holds and its numpy
    version views: in its attributes, or its parts'."""
    found = []
    for name in TRANSFORMS[type(transform)][1]:
        value = getattr(transform, name)
        for item in value if isinstance(value, list | tuple) else [value]:
            if torch.is_tensor(item):
                found.append((vars(transform) if name in vars(transform) else {name: item}, name))
            elif isinstance(item, D.Transform):
                found += transform_tensors(item)
    return found


def no_numpy_version(what: str, construct) -> NoNumpyVersion:
    """The refusal of `what` (its class, function or `.method()` `construct`), with what to write
    instead where INSTEAD knows it."""
    said = f"{what} has no numpy version in ddrl/rollout.py"
    instead = INSTEAD.get(construct)
    return NoNumpyVersion(said if instead is None else f"{said}; {instead}")


def describe(node: fx.Node, root: nn.Module, objects: dict) -> str:
    """What a node of the trace calls, as a line names it: a layer, a function, a tensor method, a
    distribution or transform class, or a method or attribute of what one of those built."""
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


def failed_in_program(error: Exception) -> str:
    """The line for `error`, raised while a derived program ran: it names what the program's line
    that failed calls (the comment that ends it); an attribute or method that a numpy version lacks
    (raised by that line itself) has none."""
    what = None
    lacks = False
    step = error.__traceback__
    while step is not None:
        if step.tb_frame.f_code.co_filename == PROGRAM_FILE:
            line = step.tb_frame.f_globals["SOURCE"].splitlines()[step.tb_lineno - 1]
            what = line.partition("  # ")[2] or None
            lacks = step.tb_next is None and isinstance(error, AttributeError)
        step = step.tb_next
    if what is None:
        return f"its numpy version failed ({type(error).__name__}: {failures.first_line(error)})"
    if lacks:
        return f"{what} has no numpy version in ddrl/rollout.py"
    return failed(what, error)


def failed(what: str, error: Exception) -> str:
    """The line for a numpy version of `what` that raised `error`."""
    said = f"{type(error).__name__}: {failures.first_line(error)}"
    return f"the numpy version of {what} failed ({said})"


def compiled(source: str, namespace: dict):
    """The function `source` defines, its globals `namespace` (and the source, by which a failure
    names its line)."""
    scope = {**namespace, "SOURCE": source}
    exec(compile(source, PROGRAM_FILE, "exec"), scope)  # noqa: S102
    return scope["method"]


# --- checking the rollout against the Agent -------------------------------------------------------
def probe(
    rollout_agent, observation_space, device: torch.device, count: int = PROBE_SAMPLES
) -> dict:
    """What the rollout's Agent does at `count` observations of `observation_space`: observations,
    actions, log-probabilities and values, as tensors on `device`; stops unless it gives one
    log-probability and one value per observation."""
    obs = example_observations(observation_space, count)
    # the probe's draws leave the rank's streams as they were, so that a resumed
    numpy_state = np.random.get_state()
    # run draws as an uninterrupted one
    with torch.random.fork_rng([device.index] if device.type == "cuda" else []):
        actions, log_probs, _, values = rollout_agent.get_action_and_value(obs)
    np.random.set_state(numpy_state)
    values = values.reshape(-1) if values.shape == (count, 1) else values
    checks.check_one_per_row(log_probs, values, count, "Agent.get_action_and_value")
    found = {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values}
    return {key: torch.as_tensor(value, device=device) for key, value in found.items()}


def example_observations(observation_space, count: int) -> np.ndarray:
    """`count` observations of `observation_space`, seeded: integers within its bounds (frames),
    else standard normal ones (which look like normalised observations, where the space is
    unbounded)."""
    rng = np.random.default_rng(0)
    shape = (count, *observation_space.shape)
    if np.issubdtype(observation_space.dtype, np.integer):
        low = np.broadcast_to(observation_space.low, observation_space.shape)
        high = np.broadcast_to(observation_space.high, observation_space.shape)
        return rng.integers(low, high, shape, endpoint=True).astype(observation_space.dtype)
    return rng.standard_normal(shape).astype(np.float32)


def check(agent: nn.Module, batch: dict, when: str, kind: str, rows: int = PROBE_SAMPLES) -> None:
    """Stop every rank unless Agent.get_action_and_value, scoring `batch`'s first `rows`
    observations and actions, gives the log-probabilities and values the rollout (`kind`) recorded
    for them."""
    obs = in_agents_dtype(agent, batch["obs"][:rows])
    actions = in_agents_dtype(agent, batch["actions"][:rows])
    with torch.no_grad():
        _, log_prob, _, value = agent.get_action_and_value(obs, actions)
    pairs = {
        "log-probabilities": (log_prob, batch["log_probs"][:rows]),
        "values": (value.reshape(-1), batch["values"][:rows]),
    }
    checks.check_agreement(when, f"the rollout ({kind}) and Agent.get_action_and_value", **pairs)
    # the update comes next: the programs derived from this Agent look for replaced tensors then
    for derived in PROGRAMS.get(agent, []):
        derived.look_again = True


def in_agents_dtype(agent: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Floating `tensor` (float32 rows of the rollout's numpy storage) in the floating dtype of the
    Agent's parameters, which may be float64; frames and discrete actions as they are."""
    dtype = next(agent.parameters()).dtype
    return tensor.to(dtype) if tensor.is_floating_point() and dtype.is_floating_point else tensor
