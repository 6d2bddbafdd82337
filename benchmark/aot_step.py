"""What one PPO minibatch step of ppo_continuous_mpi.py costs on one CPU thread: today's step (the script's loss,
backward, gradient pack, clip and fused Adam; eager and with the loss torch.compile'd) beside a pure functional step
over flat tensors (torch.func.grad of the script's own minibatch_loss, the clip and Adam written out), compiled ahead
of time with AOTInductor and called through its C++ runner, or compiled with torch.compile.

    taskset -c 1 python -m benchmark.aot_step --rounds 10 --steps 200 --out benchmark/results/aot_step
    taskset -c 1 python -m benchmark.aot_step --block 1 --out benchmark/results/aot_step_call_by_call

The functional step is traced to ATen ops with make_fx first, then exported: torch.export's own trace of
torch.func.grad runs the autograd engine on tensors without storage and stops ("Cannot access data pointer of Tensor
that doesn't have storage"). "two pieces" splits it where the gradient sync goes (the gradient and the logged numbers
in one flat tensor; the clip and Adam), with the one-rank sync and its finiteness check between. The contenders take
turns every --block steps within every round, so a slow spell of the shared machine falls on all of them; each call is
timed by this thread's CPU time, which leaves out the time it waits for a core on a busy machine, and by the wall
clock; a round's figure is its median call.
"""

import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from annotated_types import Ge
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from benchmark import common
from ddrl import collectives

SCRIPT = "ppo_continuous_mpi.py"
KEYS = ("obs", "actions", "log_probs", "advantages", "returns", "values")
BETA1, BETA2, EPS = 0.9, 0.999, 1e-5
"""the script's Adam: torch's default betas, eps=1e-5"""
TODAY, COMPILED = "today, eager loss", "today, torch.compile'd loss (--compile)"
FLOOR = "AOTInductor runner alone (same inputs; 4 adds)"
UPDATE_STEPS = 320
"""minibatch steps in an iteration's update at the defaults: 10 epochs of 32 minibatches"""


@dataclass(kw_only=True)
class Args(common.TimingArgs):
    rounds: Annotated[int, Ge(1)] = 5
    """rounds; in each, every contender runs `steps` minibatch steps at every row count"""
    steps: Annotated[int, Ge(1)] = 200
    """minibatch steps per contender per round"""
    block: Annotated[int, Ge(1)] = 20
    """consecutive steps of one contender before the next takes its turn (the update runs its steps back to back;
    1: call by call, where each step meets caches the others filled)"""
    rows: tuple[int, ...] = (8, 64)
    """minibatch sizes (64: the default's, 2048 samples in 32 minibatches on one rank)"""
    out: Path = Path("benchmark/results/aot_step")


class Loss(nn.Module):
    """The script's minibatch_loss as a forward, so torch.func.functional_call can run it on given parameters."""

    def __init__(self, module, agent: nn.Module, args):
        super().__init__()
        self.agent, self.script, self.args = agent, module, args

    def forward(self, mb: dict, adv_mean: torch.Tensor, adv_std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logged = self.script.minibatch_loss(self.agent, mb, adv_mean, adv_std, self.args)
        return loss, torch.stack(list(logged.values()))


def functional_step(module, agent: nn.Module, args) -> tuple[Callable, Callable, Callable]:
    """(gradient, clip_and_adam, whole): the minibatch step as pure functions of flat tensors, in two pieces split
    where the gradient sync goes, and whole. gradient(params, shift, scale, *minibatch, adv_mean, adv_std) ->
    [gradient, logged]; clip_and_adam(params, exp_avg, exp_avg_sq, step, lr, flat) -> (params, exp_avg, exp_avg_sq,
    step); whole(params, exp_avg, exp_avg_sq, step, lr, shift, scale, *minibatch, adv_mean, adv_std)."""
    loss = Loss(module, agent, args)
    named = [(f"agent.{name}", p.shape) for name, p in agent.named_parameters()]
    sizes = [p.numel() for p in agent.parameters()]

    def gradient(params, shift, scale, *minibatch_and_moments):
        mb = dict(zip(KEYS, minibatch_and_moments[:6], strict=True))

        def loss_of(flat):
            tensors = {name: part.view(shape) for (name, shape), part in zip(named, flat.split(sizes), strict=True)}
            tensors |= {"agent.obs_rms.shift": shift, "agent.obs_rms.scale": scale}
            return torch.func.functional_call(loss, tensors, (mb, *minibatch_and_moments[6:]))

        grads, logged = torch.func.grad(loss_of, has_aux=True)(params)
        return torch.cat([grads, logged])

    def clip_and_adam(params, exp_avg, exp_avg_sq, step, lr, flat):
        grads = flat[: params.numel()]
        grads = grads * torch.clamp(args.max_grad_norm / (grads.norm() + 1e-6), max=1.0)
        step = step + 1
        exp_avg = exp_avg.lerp(grads, 1 - BETA1)
        exp_avg_sq = exp_avg_sq * BETA2 + (1 - BETA2) * grads * grads
        denom = exp_avg_sq.sqrt() / (1 - BETA2**step).sqrt() + EPS
        return params - lr / (1 - BETA1**step) * exp_avg / denom, exp_avg, exp_avg_sq, step

    def whole(params, exp_avg, exp_avg_sq, step, lr, *data):
        return clip_and_adam(params, exp_avg, exp_avg_sq, step, lr, gradient(params, *data))

    return gradient, clip_and_adam, whole


def minibatch(rows: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """A minibatch of `rows` rows (HalfCheetah's 17 observations, 6 actions), seeded, in KEYS' order."""
    generator = torch.Generator().manual_seed(rows)
    shapes = [(rows, 17), (rows, 6), (rows,), (rows,), (rows,), (rows,)]
    tensors = [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]
    tensors[2] -= 5.0  # log-probabilities of 6 actions
    return tensors


class Setup:
    """One Agent (the script's, for HalfCheetah-v5, seeded) and what both kinds of step need, in one dtype."""

    def __init__(self, dtype: torch.dtype):
        self.module = common.load_script(SCRIPT)
        self.args = self.module.Args()
        torch.manual_seed(0)
        self.agent = common.agent_of(SCRIPT).to(dtype)
        self.gradient, self.clip_and_adam, self.whole = functional_step(self.module, self.agent, self.args)

    def today(self, tensors: list[torch.Tensor], compiled: bool) -> Callable[[], None]:
        """The script's minibatch step on a copy of the Agent, as update runs it."""
        agent = copy.deepcopy(self.agent)
        parameters = list(agent.parameters())
        optimizer = torch.optim.Adam(parameters, lr=self.args.learning_rate, eps=EPS, fused=True)
        num_weights = sum(p.numel() for p in parameters)
        loss_fn = self.module.minibatch_loss
        if compiled:
            loss_fn = torch.compile(loss_fn, fullgraph=True, dynamic=False)
        mb = dict(zip(KEYS, tensors, strict=True))
        adv_mean, adv_std = mb["advantages"].mean(), mb["advantages"].std()

        def step() -> None:
            loss, logged = loss_fn(agent, mb, adv_mean, adv_std, self.args)
            optimizer.zero_grad()
            loss.backward()
            flat = self.module.average_gradients(parameters, torch.stack(list(logged.values())))
            gradients = flat[:num_weights]
            gradients.mul_(torch.clamp(self.args.max_grad_norm / (gradients.norm() + 1e-6), max=1.0))
            optimizer.step()

        step.agent = agent
        return step

    def state(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(params, exp_avg, exp_avg_sq, step, lr) at the start, and (shift, scale, *minibatch, adv_mean, adv_std)."""
        params = torch.cat([p.detach().reshape(-1) for p in self.agent.parameters()])
        lr = torch.tensor(self.args.learning_rate, dtype=params.dtype)
        optimizer_state = [params, torch.zeros_like(params), torch.zeros_like(params), torch.zeros_like(lr), lr]
        rms = self.agent.obs_rms
        data = [rms.shift.clone(), rms.scale.clone(), *tensors, tensors[3].mean(), tensors[3].std()]
        return optimizer_state, data


def functional(whole: Callable, two: tuple[Callable, Callable] | None, state: list, data: list) -> Callable:
    """A call that takes one functional step: `whole(*state[:4], lr, *data)`, or two pieces with the one-rank sync
    between; the new params and Adam state feed the next call."""

    def step() -> None:
        if two is None:
            state[:4] = whole([*state, *data])
            return
        flat = two[0]([state[0], *data])[0]
        collectives.allreduce_mean(flat)
        if not flat.sum().isfinite():
            raise RuntimeError("a non-finite loss or gradient")
        state[:4] = two[1]([*state, flat])

    step.state = state
    return step


def aot(fn: Callable, inputs: list[torch.Tensor], folder: Path, costs: dict, name: str):
    """`fn` traced to ATen ops, exported and compiled by AOTInductor, loaded; the seconds it took go in `costs`."""
    start = time.perf_counter()
    exported = torch.export.export(make_fx(fn)(*inputs), tuple(inputs))
    path = torch._inductor.aoti_compile_and_package(exported, package_path=str(folder / f"{name}.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    costs[f"AOTInductor: make_fx, export, compile and load the {name}"] = time.perf_counter() - start
    print(f"AOTInductor: the {name} compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return runner


def boxed(runner) -> Callable:
    """The runner's C++ call, a list in and a list out (its `__call__` parses its pytree specs on every call)."""
    return lambda flat_inputs: runner.loader.boxed_run(list(flat_inputs))


def check(rows: int) -> list[str]:
    """The functional step (eager, float64) against the script's eager step over three steps: the largest gap in the
    new params, relative to the largest change of a param (as in float32's check in main)."""
    setup = Setup(torch.float64)
    tensors = minibatch(rows, torch.float64)
    today = setup.today(tensors, compiled=False)
    state, data = setup.state(tensors)
    start = state[0].clone()
    for _ in range(3):
        today()
        state[:4] = setup.whole(*state, *data)
    reference = torch.cat([p.detach().reshape(-1) for p in today.agent.parameters()])
    gap = ((state[0] - reference).abs().max() / (reference - start).abs().max()).item()
    if not gap < 1e-10:
        raise SystemExit(f"benchmark: error: the functional step is {gap:.1e} from the script's (float64)")
    return [f"float64, {rows} rows, 3 steps: the functional step's params within {gap:.1e} of the script's eager step"]


def contenders(args: Args, setup: Setup, costs: dict[str, float]) -> dict[tuple[int, str], Callable]:
    """Every contender's step at every row count, by (rows, name), compiled; the compile costs go in `costs`."""
    calls: dict[tuple[int, str], Callable] = {}
    folder = Path(tempfile.mkdtemp(prefix="aot_step_"))
    adam = None
    for rows in args.rows:
        tensors = minibatch(rows, torch.float32)
        state, data = setup.state(tensors)
        calls[rows, TODAY] = setup.today(tensors, compiled=False)
        calls[rows, COMPILED] = setup.today(tensors, compiled=True)
        compiled = torch.compile(make_fx(setup.whole)(*state, *data), fullgraph=True, dynamic=False)
        calls[rows, "functional, torch.compile'd"] = functional(
            lambda flat, compiled=compiled: compiled(*flat), None, list(state), data
        )
        runner = aot(setup.whole, [*state, *data], folder, costs, f"whole step, {rows} rows")
        calls[rows, "functional, AOTInductor"] = functional(boxed(runner), None, list(state), data)
        calls[rows, "functional, AOTInductor, runner(*inputs)"] = functional(
            lambda flat, runner=runner: runner(*flat), None, list(state), data
        )
        gradient = boxed(aot(setup.gradient, [state[0], *data], folder, costs, f"gradient, {rows} rows"))
        flat = setup.gradient(state[0], *data)
        adam = adam or boxed(aot(setup.clip_and_adam, [*state, flat], folder, costs, "clip and Adam"))
        pieces = functional(None, (gradient, adam), list(state), data)
        calls[rows, "functional, AOTInductor, two pieces + sync"] = pieces
        if rows == min(args.rows):
            floor = boxed(aot(lambda *flat: [x + 1 for x in flat[:4]], [*state, *data], folder, costs, "floor"))
            calls[rows, FLOOR] = functional(floor, None, list(state), data)
    return calls


def main(argv: list[str] | None = None) -> Path:
    args, argv, _ = common.cli(Args, argv)
    torch.set_num_threads(1)
    torch.distributions.Distribution.set_default_validate_args(False)  # as ddrl's launch does
    facts = [line for rows in args.rows for line in check(rows)]
    setup = Setup(torch.float32)
    costs: dict[str, float] = {}
    calls = contenders(args, setup, costs)
    for (rows, name), call in calls.items():  # the first calls compile and warm up
        start = time.perf_counter()
        call()
        if time.perf_counter() - start > 0.1:
            costs[f"torch.compile: the first call of {name}, {rows} rows"] = time.perf_counter() - start
        for _ in range(3):
            call()
    initial = torch.cat([p.detach().reshape(-1) for p in setup.agent.parameters()])
    gaps = []
    for (rows, name), call in calls.items():  # four steps each from the same params
        if name.startswith("functional"):
            reference = torch.cat([p.detach().reshape(-1) for p in calls[rows, TODAY].agent.parameters()])
            gaps.append(((call.state[0] - reference).abs().max() / (reference - initial).abs().max()).item())
    facts.append(f"float32, 4 steps: every functional step's params within {max(gaps):.1e} of the script's eager step")
    load = common.check_load(args.max_load)
    wall = {key: [[] for _ in range(args.rounds)] for key in calls}
    cpu = {key: [[] for _ in range(args.rounds)] for key in calls}
    for round_index in range(args.rounds):
        for _ in range(args.steps // args.block):  # the contenders take turns block by block
            for key, call in calls.items():
                for _ in range(args.block):
                    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
                    call()
                    cpu[key][round_index].append((time.thread_time_ns() - start_cpu) / 1e3)
                    wall[key][round_index].append((time.perf_counter_ns() - start) / 1e3)
    table = []
    for rows, name in calls:
        medians = [statistics.median(times) for times in cpu[rows, name]]
        median = statistics.median(medians)
        speed_up = statistics.median(map(statistics.median, cpu[rows, COMPILED])) / median
        speed_up = "" if name == FLOOR else f"{speed_up:.2f}x"
        wall_median = statistics.median(map(statistics.median, wall[rows, name]))
        update = f"{UPDATE_STEPS * median / 1e3:.0f}" if rows == 64 else ""
        spread = f"{min(medians):.0f}-{max(medians):.0f}"
        table.append([rows, name, f"{median:.0f}", spread, f"{wall_median:.0f}", speed_up, update])
        print(*table[-1], sep=" | ", file=sys.stderr)
    header = (
        "rows | minibatch step | us of CPU per step (median) | range over rounds | us of wall clock per step (median) "
        f"| speed-up over --compile (CPU) | ms of CPU per update ({UPDATE_STEPS} steps)"
    )
    body = "\n" + common.markdown_table(header, table)
    body += "\nCompile and export costs (seconds, once at start, on the shared machine):\n\n"
    body += common.markdown_table("what | seconds", [[name, f"{s:.1f}"] for name, s in costs.items()])
    facts.append(
        f"{args.rounds} rounds x {args.steps} steps per contender in turns of {args.block}, one torch thread, pinned"
    )
    return common.write_results(args, argv, "A PPO minibatch step compiled ahead of time", facts, body, load)


if __name__ == "__main__":
    main()
