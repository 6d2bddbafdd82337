"""--compile's update step (ddrl.compiled_step), on one rank in float64, against the eager update from the same
start: a researcher's KL penalty goes through it; an entropy coefficient changed between updates, a loss that reaches
a second module and an optimizer of more than the Agent each fall back to the eager step in one line naming why; and
Adam's state it leaves is torch's own, which an eager optimizer continues from. Two ranks, preempted sizes and --sync
gather: tests/test_ppo_continuous.py's union test."""

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

import ppo_continuous_mpi as ppo
from ddrl import compiled_step
from tests.helpers import assert_same_parameters
from tests.test_ppo_continuous import BATCH, EPOCHS, MINIBATCHES, UPDATE_ARGS, fixed_batch, local_orders, new_learner

SIZES = ppo.minibatch_sizes([BATCH], MINIBATCHES)


def updated(args: ppo.Args, loss_fn=ppo.minibatch_loss, compiled: bool = True, updates: int = 1, edit=None) -> tuple:
    """The Agent and optimizer after `updates` updates on fixed_batch, with the compiled step or eagerly; `edit(args,
    agent)` runs before each update. Returns (agent, optimizer, the compiled step or None)."""
    agent, optimizer = new_learner()
    step = (
        compiled_step.CompiledStep(agent, optimizer, loss_fn, ppo.average_gradients, ppo.clip_gradients, args)
        if compiled
        else None
    )
    for update in range(updates):
        if edit:
            edit(args, agent)
        ppo.update(
            agent, optimizer, fixed_batch(), args, local_orders(update, BATCH, EPOCHS), SIZES, loss_fn, None, step
        )
    return agent, optimizer, step


def warnings_of(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if "compiled update step" in line]


def kl_penalty_loss(agent, mb, adv_mean, adv_std, args):
    """PPO's loss plus a KL penalty (beta times the mean squared log-ratio), as a researcher adds one."""
    loss, logged = ppo.minibatch_loss(agent, mb, adv_mean, adv_std, args)
    _, newlogprob, _, _ = agent.get_action_and_value(mb["obs"], mb["actions"])
    penalty = ((newlogprob - mb["log_probs"]) ** 2).mean()
    return loss + agent.kl_beta * penalty, {**logged, "kl_penalty": penalty.detach()}


def adapt_beta(args: ppo.Args, agent: ppo.Agent) -> None:
    """The coefficient in a buffer of the Agent, as changing-a-script.md keeps it: 3 at first, doubled each update."""
    if not hasattr(agent, "kl_beta"):
        agent.register_buffer("kl_beta", torch.tensor(1.5, dtype=torch.float64))
    agent.kl_beta *= 2


def test_a_kl_penalty_with_its_coefficient_in_a_buffer_goes_through_the_compiled_step(capfd):
    """The coefficient changes between updates and the compiled step takes it as an input: every step compiled."""
    eager, _, _ = updated(UPDATE_ARGS, kl_penalty_loss, compiled=False, updates=2, edit=adapt_beta)
    agent, optimizer, step = updated(UPDATE_ARGS, kl_penalty_loss, updates=2, edit=adapt_beta)
    assert step.declined is None and step.calls == 2 * EPOCHS * MINIBATCHES  # every step compiled
    assert step.logged[-1] == "kl_penalty"
    assert_same_parameters([eager.state_dict(), agent.state_dict()], atol=1e-10)
    assert warnings_of(capfd) == []


def test_an_entropy_coefficient_changed_between_updates_falls_back_in_one_line(capfd):
    """The compiled step holds the coefficient it was traced with; the next update's check finds the eager loss's
    gradient differ and the update runs eagerly from its first step, so the weights are the eager run's."""
    args = dataclasses.replace(UPDATE_ARGS, ent_coef=0.0)

    def schedule() -> Callable:
        """0 at the first update, 0.05 from the second on."""
        updates = []

        def edit(args: ppo.Args, agent: ppo.Agent) -> None:
            args.ent_coef = 0.05 if updates else 0.0
            updates.append(args.ent_coef)

        return edit

    eager, _, _ = updated(dataclasses.replace(args), compiled=False, updates=2, edit=schedule())
    agent, _, step = updated(args, updates=2, edit=schedule())
    assert step.calls == EPOCHS * MINIBATCHES  # the first update's steps only
    assert_same_parameters([eager.state_dict(), agent.state_dict()], atol=1e-10)
    [line] = warnings_of(capfd)
    assert line.endswith(": the update runs eagerly") and "differs from the eager loss by" in line, line


def test_a_loss_reaching_a_second_module_falls_back_and_trains_it(capfd):
    """An intrinsic-reward predictor trained through the same loss (its parameters in the same optimizer would be
    refused before; here only the loss reaches them): the compiled step would never give them a gradient."""
    predictor = nn.Linear(5, 1).double()

    def loss_with_predictor(agent, mb, adv_mean, adv_std, args):
        loss, logged = ppo.minibatch_loss(agent, mb, adv_mean, adv_std, args)
        return loss + predictor(mb["obs"]).pow(2).mean(), logged

    agent, _, step = updated(UPDATE_ARGS, loss_with_predictor)
    assert step.calls == 0 and predictor.weight.grad is not None  # the eager backward reached it
    [line] = warnings_of(capfd)
    assert "found the loss reading tensors besides the Agent's parameters and buffers" in line, line


def test_an_optimizer_of_two_groups_falls_back(capfd):
    """Exactly the Agent's parameters in their order, in two groups with their own learning rates (the log-std's and
    the networks'): the fused kernel would step both with the first group's."""
    agent, _ = new_learner()
    [logstd, *networks] = agent.parameters()
    optimizer = torch.optim.Adam([{"params": [logstd], "lr": 0.01}, {"params": networks, "lr": 0.001}])
    step = compiled_step.CompiledStep(
        agent, optimizer, ppo.minibatch_loss, ppo.average_gradients, ppo.clip_gradients, UPDATE_ARGS
    )
    assert step.declined == "takes one torch Adam (one group, no amsgrad) of the Agent's parameters, on CPU"
    [line] = warnings_of(capfd)
    assert line.endswith(
        "takes one torch Adam (one group, no amsgrad) of the Agent's parameters, on CPU: the update runs eagerly"
    )


def test_an_optimizer_of_more_than_the_agent_falls_back_untouched(capfd):
    agent, _ = new_learner()
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    optimizer = torch.optim.Adam([*agent.parameters(), extra], lr=0.01)
    step = compiled_step.CompiledStep(
        agent, optimizer, ppo.minibatch_loss, ppo.average_gradients, ppo.clip_gradients, UPDATE_ARGS
    )
    assert step.declined == "takes one torch Adam (one group, no amsgrad) of the Agent's parameters, on CPU"
    storages = {p.untyped_storage().data_ptr() for p in agent.parameters()}
    assert optimizer.state == {} and len(storages) == len(list(agent.parameters()))  # nothing bound to a flat tensor
    ppo.update(agent, optimizer, fixed_batch(), UPDATE_ARGS, local_orders(0, BATCH, EPOCHS), SIZES, compiled=step)
    assert step.calls == 0 and int(optimizer.state[extra]["step"]) == EPOCHS * MINIBATCHES
    [line] = warnings_of(capfd)
    assert (
        "takes one torch Adam (one group, no amsgrad) of the Agent's parameters, on CPU: the update runs eagerly"
        in line
    )


def test_adam_state_is_torchs_own_and_an_eager_optimizer_continues_from_it():
    """After a compiled update, the optimizer's state_dict loads into a fresh eager learner, whose next update equals
    the compiled step's next update: the moments and step counts are where torch keeps them."""
    agent, optimizer, step = updated(UPDATE_ARGS)
    eager, eager_optimizer = new_learner()
    eager.load_state_dict(agent.state_dict())
    eager_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for learner, learner_optimizer, compiled in ((agent, optimizer, step), (eager, eager_optimizer, None)):
        orders = local_orders(1, BATCH, EPOCHS)
        ppo.update(learner, learner_optimizer, fixed_batch(), UPDATE_ARGS, orders, SIZES, compiled=compiled)
    assert step.calls == 2 * EPOCHS * MINIBATCHES
    assert_same_parameters([eager.state_dict(), agent.state_dict()], atol=1e-10)
    moments = [state["exp_avg_sq"] for state in optimizer.state.values()]
    assert all(moment.abs().max() > 0 for moment in moments)
    assert {int(state["step"]) for state in optimizer.state.values()} == {2 * EPOCHS * MINIBATCHES}


def test_without_advantage_normalisation_every_step_is_compiled(capfd):
    """--no-norm-adv: the loss takes no advantages' mean and std (None), and the compiled step takes it as it is."""
    args = dataclasses.replace(UPDATE_ARGS, norm_adv=False)
    eager, _, _ = updated(args, compiled=False)
    agent, _, step = updated(args)
    assert step.declined is None and step.calls == EPOCHS * MINIBATCHES
    assert_same_parameters([eager.state_dict(), agent.state_dict()], atol=1e-10)
    assert warnings_of(capfd) == []
