"""The rollout's Agent, derived from the Agent (numpy programs of its methods, or its torch code)
and checked against it: at one row per env, torch's per-call overhead outweighs the arithmetic."""

import functools
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from ddrl import checks, failures, tracing
from ddrl.numpy_versions import NoNumpyVersion

PROBE_SAMPLES = 256  # the probe's observations, and each batch's rows checked
NUMPY = "numpy versions of the Agent's methods"
TORCH = "the Agent's own torch code"
DERIVED = weakref.WeakKeyDictionary()


# --- the rollout's Agent --------------------------------------------------------------------------
class RolloutAgent:
    """get_action_and_value(x) (its entropy None) and get_value(x) on numpy rows, running what
    `kind` says; the numpy programs read the Agent's tensors through `views`."""

    def __init__(self, kind: str, act: Callable, value: Callable, views: list[tuple] = ()):
        self.kind = kind
        self.get_action_and_value = act
        self.get_value = value
        self.views = views
        self.addresses = addresses(views)

    def reread(self) -> None:
        """Where an update ends: views anew each tensor the update put in another's place."""
        if (now := addresses(self.views)) != self.addresses:
            for _, _, constants, key, make in self.views:
                setattr(constants, key, make())
            self.addresses = now


def derive(
    agent: nn.Module, observation_space, numpy_layers: bool = True, deterministic: bool = False
) -> RolloutAgent:
    """The rollout's Agent, derived once: numpy programs over views of its tensors, else (no
    `numpy_layers`, a GPU, no numpy version) its torch code; `deterministic` acts each mode."""
    example = example_observations(observation_space, 1)
    on_cpu = next(agent.parameters()).device.type == "cpu"
    traces = traced(agent, example, numpy_layers and on_cpu)
    if numpy_layers and on_cpu and "reason" not in traces:
        derived = numpy_agent(traces, deterministic)
        if not deterministic or not mode_problem(derived, example):
            return derived
    if not deterministic:
        return torch_agent(agent, agent.get_action_and_value)
    needs = "--eval-deterministic needs the mode of the Agent's distribution, and"
    if "reason" in traces and "get_value" not in traces:
        failures.fail(f"{needs} {traces['reason']}")
    root, graph = traces["get_action_and_value"]
    derived = torch_agent(agent, fx.Interpreter(root, graph=tracing.with_modes(graph)).run)
    if problem := mode_problem(derived, example):
        failures.fail(f"{needs} {problem}: evaluate without --eval-deterministic")
    return derived


def mode_problem(derived: RolloutAgent, example: np.ndarray) -> str:
    """Why the deterministic rollout cannot act on `example` ('' if it can), before an episode."""
    try:
        derived.get_action_and_value(example)
    except Exception as error:
        return f"{type(error).__name__}: {failures.first_line(error)}"
    return ""


def traced(agent: nn.Module, example: np.ndarray, numpy_layers: bool) -> dict:
    """The Agent's two methods traced, or why their numpy programs cannot run, once per Agent."""
    if agent in DERIVED:
        return DERIVED[agent]
    found = {}
    try:
        found = {
            method: tracing.trace(agent, method) for method in ("get_action_and_value", "get_value")
        }
    except Exception as error:  # data-dependent control flow, a call torch.fx cannot follow
        said = f"{type(error).__name__}: {failures.first_line(error)}"
        found["reason"] = f"torch.fx cannot trace it ({said})"
    if numpy_layers and "reason" not in found:
        state = np.random.get_state()  # the trial's draws leave the rank's stream as it was
        try:
            programs = [tracing.numpy_program(*trace) for trace in found.values()]
            for _, module, _ in programs:  # each node's numpy version, named where it fails
                tracing.Trial(module).run(example)
        except NoNumpyVersion as error:
            found["reason"] = str(error)
        except Exception as error:
            said = f"{type(error).__name__}: {failures.first_line(error)}"
            found["reason"] = f"its numpy version failed ({said})"
        finally:
            np.random.set_state(state)
    if numpy_layers and "reason" in found and failures.this_rank() == 0:
        failures.tell(
            f"the rollout runs the Agent's own torch code, the slower path: {found['reason']}"
        )
    DERIVED[agent] = found
    return found


def numpy_agent(traces: dict, deterministic: bool = False) -> RolloutAgent:
    """The numpy programs of the traced methods; with `deterministic`, each sample its mode."""
    root, graph = traces["get_action_and_value"]
    act, _, act_views = tracing.numpy_program(
        root, tracing.with_modes(graph) if deterministic else graph
    )
    value, _, value_views = tracing.numpy_program(*traces["get_value"])
    return RolloutAgent(NUMPY, act, value, act_views + value_views)


def torch_agent(agent: nn.Module, act: Callable) -> RolloutAgent:
    """The Agent's own get_value, and `act` (get_action_and_value, or its modes), on rows."""
    device = next(agent.parameters()).device
    return RolloutAgent(
        TORCH,
        functools.partial(on_rows, agent, act, device),
        functools.partial(on_rows, agent, agent.get_value, device),
    )


@torch.inference_mode()
def on_rows(agent: nn.Module, method: Callable, device: torch.device, x: np.ndarray):
    """`method` under inference mode on numpy rows, its results as numpy arrays."""
    found = method(in_agents_dtype(agent, torch.as_tensor(x, device=device)))
    if isinstance(found, tuple):
        return tuple(None if item is None else item.cpu().numpy() for item in found)
    return found.cpu().numpy()


# --- checking the rollout against the Agent -------------------------------------------------------
def probe(
    rollout_agent, observation_space, device: torch.device, count: int = PROBE_SAMPLES
) -> dict:
    """What the rollout's Agent gives at `count` observations (one per row, or stop) on `device`."""
    obs = example_observations(observation_space, count)
    numpy_state = np.random.get_state()  # the streams as they were: a resumed run draws alike
    with torch.random.fork_rng([device.index] if device.type == "cuda" else []):
        actions, log_probs, _, values = rollout_agent.get_action_and_value(obs)
    np.random.set_state(numpy_state)
    values = values.reshape(-1) if values.shape == (count, 1) else values
    checks.check_one_per_row(log_probs, values, count, "Agent.get_action_and_value")
    found = {"obs": obs, "actions": actions, "log_probs": log_probs, "values": values}
    return {key: torch.as_tensor(value, device=device) for key, value in found.items()}


def example_observations(observation_space, count: int) -> np.ndarray:
    """`count` seeded observations: integers within the bounds (frames), else standard normal."""
    rng = np.random.default_rng(0)
    shape = (count, *observation_space.shape)
    if np.issubdtype(observation_space.dtype, np.integer):
        low = np.broadcast_to(observation_space.low, observation_space.shape)
        high = np.broadcast_to(observation_space.high, observation_space.shape)
        return rng.integers(low, high, shape, endpoint=True).astype(observation_space.dtype)
    return rng.standard_normal(shape).astype(np.float32)


def check(agent: nn.Module, batch: dict, when: str, kind: str, rows: int = PROBE_SAMPLES) -> None:
    """Stop every rank unless `agent.get_action_and_value` gives the log-probabilities and values
    the rollout (`kind`) recorded for `batch`'s first `rows` observations and actions."""
    obs = in_agents_dtype(agent, batch["obs"][:rows])
    actions = in_agents_dtype(agent, batch["actions"][:rows])
    with torch.no_grad():
        _, log_prob, _, value = agent.get_action_and_value(obs, action=actions)
    pairs = {
        "log-probabilities": (log_prob, batch["log_probs"][:rows]),
        "values": (value.reshape(-1), batch["values"][:rows]),
    }
    checks.check_agreement(when, f"the rollout ({kind}) and Agent.get_action_and_value", **pairs)


def in_agents_dtype(agent: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Floating `tensor` in the floating dtype of the Agent's parameters; anything else as it is."""
    parameter = next(agent.parameters(), None) if isinstance(agent, nn.Module) else None
    if parameter is None or not tensor.is_floating_point() or not parameter.is_floating_point():
        return tensor
    return tensor.to(parameter.dtype)


def addresses(views: list[tuple]) -> list[int]:
    """The address of the memory of each viewed tensor, as the Agent holds it now."""
    return [holder[name].data_ptr() for holder, name, *_ in views]
