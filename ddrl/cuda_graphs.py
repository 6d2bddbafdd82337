"""CUDA graphs: the Atari rollout's acting step captured once per group of envs and replayed every step, so that a
step costs a few launches instead of hundreds; built from the Agent's RolloutPolicy.act and checked against the
Agent like the eager step (the script's check_rollout_policy)."""

from collections.abc import Callable

import numpy as np
import torch

from ddrl.failures import fail


def captured_acting_step(
    policy, obs: torch.Tensor, actions: torch.Tensor, log_probs: torch.Tensor, values: torch.Tensor,
    groups: list[slice],
) -> Callable[[int, np.ndarray, slice], np.ndarray]:  # fmt: skip
    """acting_step as CUDA graphs, one per group, captured from RolloutPolicy.act as torch's docs do (every replay draws
    fresh, seeded samples): a copy in from pinned memory, a replay that reads and writes the group's part of row
    `step`, a copy out."""
    row = torch.zeros(1, dtype=torch.long, device=obs.device)  # the row the graphs read and write
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # cuDNN and cuBLAS pick kernels and workspaces before the capture
            for group in groups:
                policy.act(obs[0, group])
    torch.cuda.current_stream().wait_stream(side)
    captured = {}  # group start: (graph, its pinned frames and actions, its actions on the device)
    for group in groups:
        graph = torch.cuda.CUDAGraph()
        try:  # thread_local: NCCL's watchdog thread may query its CUDA events during the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = policy.act(obs.index_select(0, row)[0, group])
                for store, output in zip((actions, log_probs, values), outputs, strict=True):
                    store[:, group].index_copy_(0, row, output.unsqueeze(0))
        except RuntimeError as error:  # the breaking op's error, if any, came first
            cause = str(error.__context__ or error).strip().splitlines()[0]
            fail(
                f"RolloutPolicy.act could not be captured as a CUDA graph ({cause}): an op in it or in "
                "Agent.policy_value syncs with the host; remove that op, or pass --no-cuda-graph"
            )
        frames_host = torch.empty(obs[0, group].shape, dtype=torch.uint8, pin_memory=True)
        actions_host = torch.empty(outputs[0].shape, dtype=torch.long, pin_memory=True)
        captured[group.start] = (graph, frames_host, actions_host, outputs[0])  # rewritten by every replay

    def act_by_graph_replay(step: int, frames: np.ndarray, group: slice) -> np.ndarray:
        graph, frames_host, actions_host, step_actions = captured[group.start]
        np.copyto(frames_host.numpy(), frames)  # pinned: copied ahead of the replay (numpy: no torch threads)
        obs[step, group].copy_(frames_host, non_blocking=True)
        row.fill_(step)
        graph.replay()
        actions_host.copy_(step_actions, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the group's one sync: its envs wait for actions
        return actions_host.numpy()

    return act_by_graph_replay
