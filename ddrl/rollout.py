"""The rollout's Agent, derived from the Agent and checked against it. At one observation per env,
torch's per-call overhead costs more than the arithmetic, so the MLP scripts act through numpy
programs derived from the Agent's `get_action_and_value(x)` and `get_value(x)` (traced once with
torch.fx by ddrl.tracing, over the numpy versions in ddrl.numpy_versions of its layers, functions
and torch.distributions). Where the trace meets something with no numpy version, the rollout runs
the Agent's own torch code instead (slower), and says so in one line. Either way `check` compares
what the rollout recorded with the Agent's own numbers; the script calls `reread()` where its
update ends."""

import functools
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from ddrl import checks, failures, tracing
from ddrl.numpy_versions import NoNumpyVersion

# observations of the probe at start, and rows of each batch checked against the Agent
PROBE_SAMPLES = 256
NUMPY = "numpy versions of the Agent's methods"
TORCH = "the Agent's own torch code"
# agent: its traced methods, or why the rollout runs its torch code
DERIVED = weakref.WeakKeyDictionary()


# --- the rollout's Agent --------------------------------------------------------------------------
class RolloutAgent:
    """The rollout's Agent: get_action_and_value(x) and get_value(x) on numpy rows, returning numpy
    arrays (the entropy never computed: None), running what `kind` says. The numpy programs read
    the Agent's tensors through `views` (tracing.numpy_program)."""

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
    """The rollout's Agent: numpy programs derived from its methods, or (without `numpy_layers`, on
    a GPU, or where something in them has no numpy version) its own torch code. With
    `deterministic`, actions are each distribution's mode (evaluation). Derived once, before the
    loop: the programs read the parameters and buffers through numpy views that share their memory,
    so they follow every in-place change (an optimizer step, copy_, load_state_dict, a broadcast);
    a tensor the Agent replaces rather than changes is viewed anew by `reread()`, which the script
    calls where its update ends."""
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
    """Why the deterministic rollout cannot act on `example` ('' if it can): a distribution without
    a mode (a TransformedDistribution, say), found before an episode begins."""
    try:
        derived.get_action_and_value(example)
    except Exception as error:
        return f"{type(error).__name__}: {failures.first_line(error)}"
    return ""


def traced(agent: nn.Module, example: np.ndarray, numpy_layers: bool) -> dict:
    """The Agent's two methods traced, and whether their numpy programs run on `example`
    observations: found once per Agent (its code does not change during a run); the slower path is
    said then, in one line (rank 0)."""
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
    """The numpy programs of the traced methods, over views of the Agent's parameters and buffers;
    with `deterministic`, each sample its distribution's mode."""
    root, graph = traces["get_action_and_value"]
    act, _, act_views = tracing.numpy_program(
        root, tracing.with_modes(graph) if deterministic else graph
    )
    value, _, value_views = tracing.numpy_program(*traces["get_value"])
    return RolloutAgent(NUMPY, act, value, act_views + value_views)


def torch_agent(agent: nn.Module, act: Callable) -> RolloutAgent:
    """The Agent's own get_value, and `act` (its get_action_and_value, or that method traced with
    each distribution's mode for its sample), on numpy rows."""
    device = next(agent.parameters()).device
    return RolloutAgent(
        TORCH,
        functools.partial(on_rows, agent, act, device),
        functools.partial(on_rows, agent, agent.get_value, device),
    )


@torch.inference_mode()
def on_rows(agent: nn.Module, method: Callable, device: torch.device, x: np.ndarray):
    """`method` under inference mode, on tensors made from numpy rows in the Agent's dtype; its
    results as numpy arrays."""
    found = method(in_agents_dtype(agent, torch.as_tensor(x, device=device)))
    if isinstance(found, tuple):
        return tuple(None if item is None else item.cpu().numpy() for item in found)
    return found.cpu().numpy()


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
    for them (`agent` may be any object with that method: a recurrent Agent's, its state bound)."""
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
    """Floating `tensor` (float32 rows of the rollout's numpy storage) in the floating dtype of the
    Agent's parameters, which may be float64; frames, discrete actions, and rows for anything but a
    module, as they are."""
    parameter = next(agent.parameters(), None) if isinstance(agent, nn.Module) else None
    if parameter is None or not tensor.is_floating_point() or not parameter.is_floating_point():
        return tensor
    return tensor.to(parameter.dtype)


def addresses(views: list[tuple]) -> list[int]:
    """The address of the memory of each viewed tensor, as the Agent holds it now."""
    return [holder[name].data_ptr() for holder, name, *_ in views]
