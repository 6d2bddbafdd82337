"""The numpy versions of what an Agent calls, which the derived rollout calls in place of torch's: a
distribution is a class here and a line in DISTRIBUTIONS; a function, method or layer, a line."""

import math
import operator

import numpy as np
import torch
import torch.distributions as D
import torch.nn as nn
import torch.nn.functional as F

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
SAME_IN_NUMPY = {  # tensor methods a numpy array has, and their names in numpy
    "sum": "sum",
    "mean": "mean",
    "view": "reshape",
    "reshape": "reshape",
    "argmax": "argmax",
}
DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64}
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


class NumpyNormal:
    """torch.distributions.Normal on numpy arrays, drawing from numpy's seeded generator."""

    event_dims = 0  # its event is one number

    def __init__(self, loc, scale, validate_args=None):
        self.loc = loc
        self.scale = scale
        self.drawn = None  # the last sample and its noise: its log-probability needs no division

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
    """torch.distributions.Categorical on numpy arrays, sampled by inverse CDF."""

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
    """A torch.distributions transform on numpy arrays; log |det J| summed over `event_dim` dims."""

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
    """torch.distributions.TransformedDistribution on numpy arrays."""

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
    """What the Agent does that has no numpy version, and what to write instead where ddrl knows."""


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
    """The parts in order; each part's log |det J| summed over the dims of the whole's event."""
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


# torch's transforms: their numpy versions, and the torch transform's attributes they take
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


def numpy_layer(module: nn.Module):
    """A leaf module as a function of numpy rows over views of its parameters, or None."""
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
    """A numpy view of `holder[name]`, sharing its memory: it follows every change made in place."""
    return holder[name].detach().numpy()


def layer_parameters(module: nn.Module) -> list[str]:
    """The names of a layer's own parameters (not None: a Linear's missing bias is)."""
    return [name for name, value in module._parameters.items() if value is not None]


def no_numpy_version(what: str, construct) -> NoNumpyVersion:
    """The refusal of `what` (`construct`), with what to write instead where INSTEAD knows it."""
    said = f"{what} has no numpy version in ddrl/numpy_versions.py"
    instead = INSTEAD.get(construct)
    return NoNumpyVersion(said if instead is None else f"{said}; {instead}")
