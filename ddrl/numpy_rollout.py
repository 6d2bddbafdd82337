"""The MLP scripts' rollout: the Agent's own `policy` and `value` methods run on numpy rows, with numpy copies of the
modules and parameters they use. At one observation per env, torch's per-call overhead costs more than the
arithmetic; the scripts check the copies against the Agent (checks.check_agreement) before the first step and on
every rollout's batch."""

import functools

import numpy as np
import torch
import torch.nn as nn

from ddrl import checks
from ddrl.failures import fail

PROBE_SAMPLES = 256  # observations of the probe, and rows of a batch checked against the Agent


class NumpyPolicy:
    """The Agent's `policy` and `value` as they are now, run on numpy copies of the modules and parameters they use
    (numpy_module makes each copy at its first use; a rollout never changes them). Without `numpy_layers`, the
    Agent's torch modules run on the rows instead (slower; any layer)."""

    def __init__(self, agent: nn.Module, numpy_layers: bool = True):
        self.agent = agent
        self.numpy_layers = numpy_layers

    def __getattr__(self, name: str):
        """An Agent attribute that `policy` or `value` use, as numpy: copied at first use, then kept here."""
        part = numpy_module(getattr(self.agent, name), self.numpy_layers)
        setattr(self, name, part)
        return part

    def policy(self, obs: np.ndarray):
        """The Agent's action distribution at `obs`, computed by its own method on the numpy copies."""
        return type(self.agent).policy(self, obs)

    def value(self, obs: np.ndarray) -> np.ndarray:
        """The Agent's value at `obs`, computed by its own method on the numpy copies."""
        return type(self.agent).value(self, obs)

    def act(self, obs: np.ndarray, deterministic: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sampled (or modal) actions, their log-probabilities and the values at `obs` [envs, obs_dim]."""
        actions, log_probs = self.policy(obs).sample(deterministic)
        return actions, log_probs, self.value(obs)


def numpy_module(part, numpy_layers: bool = True):
    """An Agent attribute for numpy rows: a module as a function of rows (layer by layer; an unknown layer stops with
    the fix), a parameter as its array, anything else as it is. Not `numpy_layers`: the module itself on tensors."""
    if isinstance(part, torch.Tensor):
        return part.detach().cpu().numpy()
    if not isinstance(part, nn.Module):
        return part
    params = {name: p.detach().cpu().numpy() for name, p in part.named_parameters(recurse=False)}
    if not numpy_layers:  # the module itself, whatever its layers, on tensors of the rows
        device = next(part.parameters()).device
        return torch.no_grad()(lambda x: part(torch.as_tensor(x, device=device)).cpu().numpy())
    if isinstance(part, nn.Sequential):
        layers = [numpy_module(layer) for layer in part]
        return lambda x: functools.reduce(lambda rows, layer: layer(rows), layers, x)
    if isinstance(part, nn.Linear):
        weight = params["weight"].T
        bias = params.get("bias", 0.0)
        return lambda x: x @ weight + bias
    if isinstance(part, nn.LayerNorm) and len(part.normalized_shape) == 1:
        weight = params.get("weight", 1.0)
        bias = params.get("bias", 0.0)
        eps = part.eps
        return lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * weight + bias
    activations = {
        nn.Identity: lambda x: x,
        nn.Tanh: np.tanh,
        nn.ReLU: lambda x: np.maximum(x, 0),
        nn.ELU: lambda x: np.where(x > 0, x, part.alpha * np.expm1(np.minimum(x, 0))),
        nn.LeakyReLU: lambda x: np.where(x > 0, x, part.negative_slope * x),
        nn.SiLU: lambda x: x / (1 + np.exp(-x)),
        nn.Sigmoid: lambda x: 1 / (1 + np.exp(-x)),
        nn.Softplus: lambda x: np.logaddexp(0, part.beta * x) / part.beta,
    }
    if type(part) not in activations:
        fail(
            f"the rollout has no numpy version of the Agent's layer {part!r}: add one to ddrl/numpy_rollout.py's "
            "numpy_module(), or pass --no-numpy-rollout (the rollout then calls the Agent's torch modules, slower)"
        )
    return activations[type(part)]


def probe(policy: NumpyPolicy, obs_dim: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What `policy` does at standard-normal observations (which look like normalised ones): observations, actions,
    log-probabilities and values, as float32 tensors on `device`, for the scripts' check against the Agent."""
    obs = np.random.standard_normal((PROBE_SAMPLES, obs_dim)).astype(np.float32)
    try:
        actions, log_probs, values = policy.act(obs)
    except (TypeError, AttributeError) as error:  # a torch-only call in the Agent's policy or value
        fail(
            f"the rollout cannot run Agent.policy or Agent.value on numpy rows ({type(error).__name__}: {error}): "
            "compute them with the Agent's modules and with operators numpy and torch share (nn.Tanh(), not "
            "torch.tanh); a recurrent layer needs a rollout that carries its state (docs/changing-a-script.md)"
        )
    checks.check_one_per_row(log_probs, values, PROBE_SAMPLES, "Agent.policy and Agent.value")
    found = {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values}
    return {key: torch.as_tensor(value, dtype=torch.float32, device=device) for key, value in found.items()}
