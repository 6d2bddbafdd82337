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
DISTRIBUTION = D.Distribution  # kept: tracing replaces the names of its subclasses for a while
# the place of the entropy among get_action_and_value's results: a rollout never needs it
ENTROPY = 2


# --- tracing the Agent ----------------------------------------------------------------------------
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
    """torch.fx's tracer, keeping transforms and other constants in the graph as they are, and
    buffers (statistics that change as the run goes) as references, never as the values they had
    when traced."""

    proxy_buffer_attributes = True

    def create_arg(self, a):
        if isinstance(a, D.Transform | D.Distribution):
            return a
        return super().create_arg(a)


def distribution_namespaces(agent: nn.Module) -> list[dict]:
    """The namespaces where the Agent's code may find a distribution class: the globals of its
    modules' methods (a script's, whatever name it was imported under), torch.distributions and its
    submodules."""
    namespaces = {}
    for module in agent.modules():
        for cls in type(module).__mro__:
            for value in vars(cls).values():
                if isinstance(value, types.FunctionType):
                    namespaces[id(value.__globals__)] = value.__globals__
    modules = [D, *(value for value in vars(D).values() if isinstance(value, types.ModuleType))]
    return [*namespaces.values(), *(vars(module) for module in modules)]


def trace(agent: nn.Module, method: str) -> tuple[AgentMethod, fx.Graph]:
    """`agent.method(x)` (get_value, or get_action_and_value with action=None) as a torch.fx graph.
    A distribution the Agent builds from traced values becomes one node, its class the node's target
    (its methods, nodes of their own)."""
    tracer = DistributionTracer()

    def record(cls):
        @functools.wraps(cls)
        def build(*args, **kwargs):
            if any(isinstance(arg, fx.Proxy) for arg in (*args, *kwargs.values())):
                return tracer.create_proxy("call_function", cls, args, kwargs)
            return cls(*args, **kwargs)

        return build

    patched = []
    for namespace in distribution_namespaces(agent):
        for name, value in list(namespace.items()):
            if (
                isinstance(value, type)
                and issubclass(value, DISTRIBUTION)
                and value is not DISTRIBUTION
            ):
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
    "tanh": np.tanh,
    "sigmoid": sigmoid,
    "sqrt": np.sqrt,
    "abs": np.abs,
    "clamp": clamp,
    "clip": clamp,
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
    "chunk": np.array_split,
    "split": split,
    "size": lambda x, dim=None: x.shape if dim is None else x.shape[dim],
    "type_as": lambda x, other: x.astype(other.dtype),
}
SAME_IN_NUMPY = {
    "sum": "sum",
    "mean": "mean",
    "view": "reshape",
    "reshape": "reshape",
    "argmax": "argmax",
}
DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.long: np.int64,
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
    nn.Softmax: lambda module: lambda x: softmax(x, module.dim),
    nn.LogSoftmax: lambda module: lambda x: log_softmax(x, module.dim),
    nn.Flatten: lambda module: lambda x: flatten(x, module.start_dim, module.end_dim),
}


def numpy_layer(module: nn.Module):
    """A leaf module of the Agent as a function of numpy rows, over views of its parameters; None if
    it has none."""
    params = {name: p.detach().cpu().numpy() for name, p in module.named_parameters(recurse=False)}
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
    return None


class NumpyNormal:
    """torch.distributions.Normal on numpy arrays, drawing from numpy's seeded generator."""

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


class NumpyCategorical:
    """torch.distributions.Categorical on numpy arrays: sampled by inverse CDF from numpy's seeded
    generator."""

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


log_gamma = np.vectorize(math.lgamma, otypes=[np.float64])


class NumpyBeta:
    """torch.distributions.Beta on numpy arrays, drawing from numpy's seeded generator."""

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
        self.base = base_distribution
        self.axes = tuple(range(-reinterpreted_batch_ndims, 0))

    def sample(self, sample_shape=()):
        return self.base.sample(sample_shape)

    rsample = sample

    def log_prob(self, value):
        return self.base.log_prob(value).sum(self.axes)

    def entropy(self):
        return self.base.entropy().sum(self.axes)

    @property
    def mode(self):
        return self.base.mode

    @property
    def mean(self):
        return self.base.mean


class NumpyTransform:
    """An elementwise torch.distributions transform on numpy arrays: forward, inverse, log |det J|
    (log_abs_det_jacobian)."""

    def __init__(self, forward, inverse, log_abs_det_jacobian):
        self.forward = forward
        self.inverse = inverse
        self.log_abs_det_jacobian = log_abs_det_jacobian


def numpy_transform(transform: D.Transform) -> NumpyTransform | None:
    """The numpy version of a torch transform (tanh, affine, exp, sigmoid), or None."""
    if isinstance(transform, D.TanhTransform):
        return NumpyTransform(
            np.tanh, np.arctanh, lambda x, y: 2.0 * (math.log(2.0) - x - softplus(-2.0 * x))
        )
    if isinstance(transform, D.AffineTransform) and transform.event_dim == 0:
        loc = np.asarray(transform.loc.cpu() if torch.is_tensor(transform.loc) else transform.loc)
        scale = np.asarray(
            transform.scale.cpu() if torch.is_tensor(transform.scale) else transform.scale
        )
        return NumpyTransform(
            lambda x: loc + scale * x,
            lambda y: (y - loc) / scale,
            lambda x, y: np.broadcast_to(np.log(np.abs(scale)), x.shape),
        )
    if isinstance(transform, D.ExpTransform):
        return NumpyTransform(np.exp, np.log, lambda x, y: x)
    if isinstance(transform, D.SigmoidTransform):
        return NumpyTransform(
            sigmoid, lambda y: np.log(y) - np.log1p(-y), lambda x, y: -softplus(-x) - softplus(x)
        )
    return None


class NumpyTransformed:
    """torch.distributions.TransformedDistribution on numpy arrays, for elementwise transforms."""

    def __init__(self, base_distribution, transforms, validate_args=None):
        self.base = base_distribution
        self.transforms = transforms if isinstance(transforms, list) else [transforms]
        if any(transform is None for transform in self.transforms):
            raise NotImplementedError("a transform without a numpy version")

    def sample(self, sample_shape=()):
        x = self.base.sample(sample_shape)
        for transform in self.transforms:
            x = transform.forward(x)
        return x

    rsample = sample

    def log_prob(self, value):
        log_prob = 0.0
        y = value
        for transform in reversed(self.transforms):
            x = transform.inverse(y)
            log_prob = log_prob - transform.log_abs_det_jacobian(x, y)
            y = x
        return log_prob + self.base.log_prob(y)


DISTRIBUTIONS = {
    D.Normal: NumpyNormal,
    D.Categorical: NumpyCategorical,
    D.Beta: NumpyBeta,
    D.Independent: NumpyIndependent,
    D.TransformedDistribution: NumpyTransformed,
}


# --- a traced method as a Python function ---------------------------------------------------------
class NoNumpyVersion(Exception):
    """Something the Agent's method does that ddrl has no numpy version of."""


def program(root: nn.Module, graph: fx.Graph, to_numpy: bool, deterministic: bool = False):
    """The traced method as Python source, run over a namespace of what its nodes call: numpy
    versions (`to_numpy`), or the torch ones themselves. The entropy of get_action_and_value is
    never computed; with `deterministic`, a distribution's `sample()` is its mode. Returns (source,
    namespace)."""
    nodes = list(graph.nodes)
    output = nodes[-1]
    results = output.args[0]
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
    namespace = {}
    names = {}
    lines = ["def method(x):"]

    def constant(value) -> str:
        key = f"k{len(namespace)}"
        namespace[key] = value
        return key

    def render(arg) -> str:
        if isinstance(arg, fx.Node):
            return names[arg]
        if isinstance(arg, tuple | list):
            inside = ", ".join(render(item) for item in arg)
            return f"({inside},)" if isinstance(arg, tuple) else f"[{inside}]"
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{key!r}: {render(item)}" for key, item in arg.items()) + "}"
        if isinstance(arg, slice):
            return f"slice({render(arg.start)}, {render(arg.stop)}, {render(arg.step)})"
        if (
            arg is None
            or isinstance(arg, bool | int | str)
            or (isinstance(arg, float) and math.isfinite(arg))
        ):
            return repr(arg)
        if to_numpy and isinstance(arg, torch.dtype):
            if arg not in DTYPES:
                raise NoNumpyVersion(f"the dtype {arg}")
            return constant(DTYPES[arg])
        if to_numpy and isinstance(arg, D.Transform):
            if (transform := numpy_transform(arg)) is None:
                raise NoNumpyVersion(f"the transform {type(arg).__name__}")
            return constant(transform)
        return constant(arg)

    # the nodes that make a distribution: their methods are called on it directly
    distributions = set()
    for node in nodes[:-1]:
        if node not in live:
            continue
        name = f"v{len(names)}"
        names[node] = name
        args = [render(arg) for arg in node.args] + [
            f"{key}={render(value)}" for key, value in node.kwargs.items()
        ]
        if node.op == "placeholder":
            lines.append(f"    {name} = x")
        elif node.op == "get_attr":
            tensor = operator.attrgetter(node.target)(root)
            names[node] = constant(tensor.detach().cpu().numpy() if to_numpy else tensor)
        elif node.op == "call_module":
            module = root.get_submodule(node.target)
            layer = numpy_layer(module) if to_numpy else module
            if layer is None:
                raise NoNumpyVersion(
                    f"the layer {type(module).__name__} ({node.target.removeprefix('agent.')})"
                )
            lines.append(f"    {name} = {constant(layer)}({', '.join(args)})")
        elif node.op == "call_function":
            target = node.target
            if isinstance(target, type) and issubclass(target, DISTRIBUTION):
                distributions.add(node)
            if to_numpy:
                target = DISTRIBUTIONS.get(target) or FUNCTIONS.get(target)
                if target is None:
                    module = getattr(node.target, "__module__", "")
                    raise NoNumpyVersion(
                        f"the function {module}.{getattr(node.target, '__name__', node.target)}"
                    )
            lines.append(f"    {name} = {constant(target)}({', '.join(args)})")
        elif node.op == "call_method":
            receiver, *rest = args
            if deterministic and node.target in ("sample", "rsample"):
                lines.append(f"    {name} = {receiver}.mode")
            elif node.args[0] in distributions or not to_numpy:
                lines.append(f"    {name} = {receiver}.{node.target}({', '.join(rest)})")
            # numpy's method takes torch's arguments
            elif node.target in SAME_IN_NUMPY and not node.kwargs:
                lines.append(
                    f"    {name} = {receiver}.{SAME_IN_NUMPY[node.target]}({', '.join(rest)})"
                )
            elif node.target in METHODS:
                lines.append(f"    {name} = {constant(METHODS[node.target])}({', '.join(args)})")
            else:
                raise NoNumpyVersion(f"the tensor method .{node.target}()")
    returned = (
        [render(result) if place != ENTROPY else "None" for place, result in enumerate(results)]
        if isinstance(results, tuple)
        else [render(results)]
    )
    lines.append(
        f"    return ({', '.join(returned)},)"
        if isinstance(results, tuple)
        else f"    return {returned[0]}"
    )
    return "\n".join(lines), namespace


def compiled(source: str, namespace: dict):
    """The function `source` defines, its globals `namespace`."""
    scope = dict(namespace)
    exec(compile(source, "<the Agent's method, derived by ddrl.rollout>", "exec"), scope)  # noqa: S102
    return scope["method"]


# --- the rollout's Agent --------------------------------------------------------------------------
class NumpyAgent:
    """The Agent's get_action_and_value and get_value as numpy programs over views of its
    parameters, as they are now (a rollout never changes them). Takes and returns numpy arrays; the
    entropy is never computed (None)."""

    kind = "numpy versions of the Agent's methods"

    def __init__(self, act, value):
        self.get_action_and_value = act
        self.get_value = value


class TorchAgent:
    """The Agent's own get_action_and_value and get_value under inference mode, on tensors made from
    numpy rows; with `act`, that program (the traced method with each distribution's mode for its
    sample) instead."""

    kind = "the Agent's own torch code"

    def __init__(self, agent: nn.Module, act=None):
        self.agent = agent
        self.act = act or agent.get_action_and_value
        self.device = next(agent.parameters()).device

    @torch.inference_mode()
    def get_action_and_value(self, x: np.ndarray) -> tuple:
        found = self.act(torch.as_tensor(x, device=self.device))
        return tuple(None if item is None else item.cpu().numpy() for item in found)

    @torch.inference_mode()
    def get_value(self, x: np.ndarray) -> np.ndarray:
        return self.agent.get_value(torch.as_tensor(x, device=self.device)).cpu().numpy()


# agent: its traced methods, or why the rollout runs its torch code
DERIVED = weakref.WeakKeyDictionary()


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
            numpy_agent(found).get_action_and_value(example)
        except (NoNumpyVersion, NotImplementedError) as error:
            found["reason"] = f"{error} has no numpy version in ddrl/rollout.py"
        except Exception as error:
            found["reason"] = (
                f"its numpy version failed ({type(error).__name__}: {failures.first_line(error)})"
            )
        finally:
            np.random.set_state(state)
    if numpy_layers and "reason" in found and failures.this_rank() == 0:
        failures.tell(
            f"the rollout runs the Agent's own torch code, the slower path: {found['reason']}"
        )
    DERIVED[agent] = found
    return found


def numpy_agent(methods: dict, deterministic: bool = False) -> NumpyAgent:
    """The numpy programs of the traced methods, over views of the Agent's parameters as they are
    now."""
    act = compiled(*program(*methods["get_action_and_value"], True, deterministic))
    value = compiled(*program(*methods["get_value"], True))
    return NumpyAgent(act, value)


def derive(
    agent: nn.Module, observation_space, numpy_layers: bool = True, deterministic: bool = False
) -> NumpyAgent | TorchAgent:
    """The rollout's Agent, as the Agent is now: numpy programs derived from its methods, or
    (without `numpy_layers`, on a GPU, or where something in them has no numpy version) its own
    torch code. With `deterministic`, actions are each distribution's mode (evaluation)."""
    example = example_observations(observation_space, 1)
    on_cpu = next(agent.parameters()).device.type == "cpu"
    methods = traced(agent, example, numpy_layers and on_cpu)
    if numpy_layers and on_cpu and "reason" not in methods:
        return numpy_agent(methods, deterministic)
    if not deterministic:
        return TorchAgent(agent)
    if "reason" in methods and "get_value" not in methods:
        failures.fail(
            "--eval-deterministic needs the mode of the Agent's distribution, and "
            f"{methods['reason']}"
        )
    return TorchAgent(agent, compiled(*program(*methods["get_action_and_value"], False, True)))


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


def check(agent: nn.Module, batch: dict, when: str, kind: str, rows: int = PROBE_SAMPLES) -> None:
    """Stop every rank unless Agent.get_action_and_value, scoring `batch`'s first `rows`
    observations and actions, gives the log-probabilities and values the rollout (`kind`) recorded
    for them."""
    with torch.no_grad():
        _, log_prob, _, value = agent.get_action_and_value(
            batch["obs"][:rows], batch["actions"][:rows]
        )
    pairs = {
        "log-probabilities": (log_prob, batch["log_probs"][:rows]),
        "values": (value.reshape(-1), batch["values"][:rows]),
    }
    checks.check_agreement(when, f"the rollout ({kind}) and Agent.get_action_and_value", **pairs)
