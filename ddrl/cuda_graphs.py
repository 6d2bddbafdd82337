"""The Atari rollout's acting step: eager, or on a GPU one CUDA graph per group of envs, so that a
step costs a few launches instead of hundreds; and the bfloat16 trunk of --bf16."""

import types
from collections.abc import Callable

import numpy as np
import torch
import torch.nn as nn

from ddrl import collectives, machine
from ddrl.failures import fail, warn


def acting_step(
    agent: nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    log_probs: torch.Tensor,
    values: torch.Tensor,
    groups: list[slice],
    graph: bool,
) -> Callable[[int, np.ndarray, slice], np.ndarray]:
    """`act(step, frames, group)`: the frames into row `step` of `obs`, get_action_and_value on them
    into that row of the storage, the actions back to the host; with `graph`, CUDA graphs of it."""
    if graph:
        return captured_acting_step(agent, obs, actions, log_probs, values, groups)

    @torch.inference_mode()
    def act_eagerly(step: int, frames: np.ndarray, group: slice) -> np.ndarray:
        obs[step, group].copy_(torch.from_numpy(frames), non_blocking=True)
        step_actions, log_probs[step, group], _, step_values = agent.get_action_and_value(
            obs[step, group]
        )
        values[step, group] = step_values.flatten()
        actions[step, group] = step_actions
        return step_actions.cpu().numpy()

    return act_eagerly


def captured_acting_step(
    agent: nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    log_probs: torch.Tensor,
    values: torch.Tensor,
    groups: list[slice],
) -> Callable[[int, np.ndarray, slice], np.ndarray]:
    """acting_step as CUDA graphs, one per group, captured as torch's docs do (every replay draws
    fresh, seeded samples): a copy in from pinned memory, a replay, a copy out."""
    row = torch.zeros(1, dtype=torch.long, device=obs.device)  # the row the graphs read and write
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):  # cuDNN and cuBLAS pick kernels and workspaces before the capture
            for group in groups:
                agent.get_action_and_value(obs[0, group])
    torch.cuda.current_stream().wait_stream(side)
    captured = {}  # group start: (graph, its pinned frames and actions, its actions on the device)
    for group in groups:
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: NCCL's watchdog thread may query its CUDA events during the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"), torch.inference_mode():
                step_actions, step_log_probs, _, step_values = agent.get_action_and_value(
                    obs.index_select(0, row)[0, group]
                )
                outputs = (step_actions, step_log_probs, step_values.flatten())
                for store, output in zip((actions, log_probs, values), outputs, strict=True):
                    store[:, group].index_copy_(0, row, output.unsqueeze(0))
        except RuntimeError as error:  # the breaking op's error, if any, came first
            cause = str(error.__context__ or error).strip().splitlines()[0]
            fail(
                f"Agent.get_action_and_value could not be captured as a CUDA graph ({cause}): an "
                "op in it syncs with the host; remove that op, or pass --no-cuda-graph"
            )
        frames_host = torch.empty(obs[0, group].shape, dtype=torch.uint8, pin_memory=True)
        actions_host = torch.empty(step_actions.shape, dtype=torch.long, pin_memory=True)
        captured[group.start] = (graph, frames_host, actions_host, step_actions)

    def act_by_graph_replay(step: int, frames: np.ndarray, group: slice) -> np.ndarray:
        graph, frames_host, actions_host, step_actions = captured[group.start]
        np.copyto(frames_host.numpy(), frames)
        obs[step, group].copy_(frames_host, non_blocking=True)
        row.fill_(step)
        graph.replay()
        actions_host.copy_(step_actions, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the group's one sync: its envs wait for actions
        return actions_host.numpy()

    return act_by_graph_replay


def run_in_bfloat16(module: nn.Module) -> None:
    """From now on `module` runs under bfloat16 autocast and hands on float32, its forward wrapped
    on this instance (its state dict unchanged); rank 0 warns where bfloat16 is emulated."""
    device = next(module.parameters()).device
    if collectives.rank_in() == 0 and not machine.has_native_bf16(device):
        warn(f"this {device.type} emulates bfloat16, so --bf16 is slower here")

    def forward_in_bfloat16(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return type(self).forward(self, x).float()

    module.forward = types.MethodType(forward_in_bfloat16, module)
