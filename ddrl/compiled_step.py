"""The update's minibatch step derived from the script's loss, compiled ahead of time: the loss's
gradient by the flat parameters (torch.func), exported for any row count, AOTInductor's, run without
autograd; then the script's own sync and clip and torch's fused Adam kernel on flat tensors the
parameters and Adam's moments view. Each update's first step is checked against the eager loss;
where it differs or cannot be built, one line, and the script's eager step from then on."""

import hashlib
import os
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module as parameters_set_to

from ddrl import collectives, failures

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}  # of the gradient's largest entry
MOMENTS = ("exp_avg", "exp_avg_sq")
Distribution = torch.distributions.Distribution


class CompiledStep:
    """Called as the update's step, returns the world's mean gradient then the numbers the loss logs
    (names in `logged`), flat, the clip and Adam applied; None where it declines."""

    def __init__(
        self, agent: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
        sync: Callable, clip: Callable, args: object,
    ):  # fmt: skip
        self.agent = agent
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.sync = sync  # the script's average_gradients(parameters, logged, group)
        self.clip = clip
        self.args = args
        self.parameters = list(agent.parameters())
        self.names = [name for name, _ in agent.named_parameters()]
        self.buffers = dict(agent.named_buffers())
        self.run = None  # the compiled gradient, built at the first call
        self.calls = 0
        self.keys = []  # the minibatch's, in the order the compiled gradient takes them
        self.absent = []  # which of the advantages' mean and std were None where it was built
        self.logged = []  # the names of the numbers the loss logs
        self.sync_time = 0.0  # the last step's seconds in the collective
        group = optimizer.param_groups[0]
        takes = (
            type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and not group["amsgrad"]
            # its first group exactly the Agent's parameters, so the only group (a parameter is in
            # one group): the kernel takes one group's options
            and [id(p) for p in group["params"]] == [id(p) for p in self.parameters]
            and self.parameters[0].device.type == "cpu"
        )
        self.declined = None  # else why, said once
        if not takes:
            self.declined = (
                "takes one torch Adam (one group, no amsgrad) of the Agent's parameters, on CPU"
            )
            if collectives.rank_in() == 0:
                failures.warn(f"the compiled update step {self.declined}: the update runs eagerly")
            return
        self.flat = bind(self.parameters, lambda p: p.data, lambda p, x: setattr(p, "data", x))
        self.moments = [bind_state(optimizer, self.parameters, key) for key in MOMENTS]
        zero = torch.zeros((), dtype=torch.float32)  # torch's fused Adam's step counter
        steps = [optimizer.state[p].get("step", zero) for p in self.parameters]
        self.steps = torch.stack(steps)  # one add counts a step of every parameter
        for p, step in zip(self.parameters, self.steps, strict=True):
            optimizer.state[p]["step"] = step

    def __call__(
        self, mb: dict, adv_mean: torch.Tensor | None, adv_std: torch.Tensor | None,
        weight: float, group: collectives.Group = None,
    ) -> torch.Tensor | None:  # fmt: skip
        self.sync_time = 0.0
        moments = [adv_mean, adv_std, weight]
        absent = [moment is None for moment in moments]
        # a row alone, or moments the compiled gradient does not take: the eager step
        if self.declined or len(next(iter(mb.values()))) < 2 or self.absent not in ([], absent):
            return None
        moments[-1] = torch.tensor(weight, dtype=self.flat.dtype)
        checked = self.calls % (self.args.update_epochs * self.args.num_minibatches) == 0
        if checked:  # a buffer the Agent was given anew since
            self.buffers = dict(self.agent.named_buffers())
        given = [moment for moment in moments if moment is not None]
        inputs = [self.flat, *self.buffers.values(), *mb.values(), *given]
        if checked:
            self.declined = self.differs(mb, moments, inputs)
            if self.declined:
                failures.warn(f"the compiled update step {self.declined}: the update runs eagerly")
                return None
        self.calls += 1
        start = time.perf_counter()
        flat = self.sync([], self.run(inputs)[0], group)  # no .grad to write: all of it flat
        self.sync_time = time.perf_counter() - start
        gradients = flat[: self.flat.numel()]
        self.clip(gradients, self.args.max_grad_norm)
        self.steps.add_(1)
        adam = self.optimizer.param_groups[0]
        kernel = torch._fused_adamw_ if adam.get("decoupled_weight_decay") else torch._fused_adam_
        beta1, beta2 = adam["betas"]
        options = {name: adam[name] for name in ("lr", "weight_decay", "eps", "maximize")}
        kernel([self.flat], [gradients], *([m] for m in self.moments), [], [self.steps[0]],
               amsgrad=False, beta1=beta1, beta2=beta2, **options)  # fmt: skip
        return flat

    def loss(self, tensors: dict, mb: dict, *moments: torch.Tensor) -> tuple:
        """The script's loss, weighted by moments[-1], and its logged numbers, with the Agent's
        `tensors` (by name) in place of its own."""
        with parameters_set_to(self.agent, tensors):
            loss, logged = self.loss_fn(self.agent, mb, *moments[:-1], self.args)
        self.logged = list(logged)
        return loss * moments[-1], torch.stack(list(logged.values())) * moments[-1]

    def gradient(self, params: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """The loss's gradient by the flat parameters, then the logged numbers: a pure function."""
        buffers = dict(zip(self.buffers, rest, strict=False))
        mb = dict(zip(self.keys, rest[len(buffers) :], strict=False))
        given = iter(rest[len(buffers) + len(mb) :])
        moments = [None if absent else next(given) for absent in self.absent]
        sizes = [p.numel() for p in self.parameters]

        def loss_of(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pieces = zip(self.names, flat.split(sizes), self.parameters, strict=True)
            tensors = {name: piece.view_as(p) for name, piece, p in pieces}
            return self.loss(tensors | buffers, mb, *moments)

        return torch.cat(torch.func.grad(loss_of, has_aux=True)(params))

    def build(self, mb: dict, moments: list, inputs: list[torch.Tensor]) -> str | None:
        """Trace, export and compile the gradient, or load it compiled before: why not, or None."""
        self.keys = list(mb)
        self.absent = [moment is None for moment in moments]
        first = 1 + len(self.buffers)
        rows = torch.export.Dim("rows", min=2)
        dynamic = [{0: rows} if first <= i < first + len(mb) else None for i in range(len(inputs))]
        validating = Distribution._validate_args  # its checks read values: the trace has none
        try:
            Distribution.set_default_validate_args(False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = make_fx(self.gradient, tracing_mode="symbolic")(*inputs)
                self.run = load(torch.export.export(traced, tuple(inputs), dynamic_shapes=dynamic))
        except Exception as error:  # a construct the trace, the export or the compiler cannot take
            if "FakeTensor" in str(error):  # a tensor the trace cannot take as an input
                return "found the loss reading tensors besides the Agent's parameters and buffers"
            return (
                f"could not be built ({type(error).__name__}: {str(error).strip().splitlines()[0]})"
            )
        finally:
            Distribution.set_default_validate_args(validating)

    def differs(self, mb: dict, moments: list, inputs: list[torch.Tensor]) -> str | None:
        """How this step's gradient and logged numbers differ from the eager loss's (built at the
        first call), or None."""
        loss, logged = self.loss({}, mb, *moments)
        if self.run is None and (problem := self.build(mb, moments, inputs)):
            return problem
        gradients = torch.autograd.grad(
            loss, self.parameters, allow_unused=True, materialize_grads=True
        )
        eager = torch.cat([*(g.reshape(-1) for g in gradients), logged.detach()])
        gap = (
            (self.run(inputs)[0] - eager).abs().max() / eager.abs().max().clamp(min=1e-30)
        ).item()
        if not gap <= TOLERANCE.get(eager.dtype, 1e-3):
            return f"differs from the eager loss by {gap:.1e} of its largest entry"


def bind_state(optimizer: torch.optim.Optimizer, parameters: list, key: str) -> torch.Tensor:
    """bind() of the optimizer's `key` state (zeros where it has none yet)."""
    state = optimizer.state
    read = lambda p: state[p].get(key, torch.zeros_like(p))  # noqa: E731
    return bind(parameters, read, lambda p, x: state[p].__setitem__(key, x))


def bind(parameters: list[torch.Tensor], read: Callable, write: Callable) -> torch.Tensor:
    """One flat tensor holding read(p) of every parameter, each then written back as its view."""
    flat = torch.cat([read(p).detach().reshape(-1) for p in parameters])
    for p, piece in zip(parameters, flat.split([p.numel() for p in parameters]), strict=True):
        write(p, piece.view_as(p))
    return flat


def load(exported: torch.export.ExportedProgram) -> Callable:
    """The exported program compiled by AOTInductor, kept in Inductor's cache by its code (a later
    run of the same loss loads it), called with a list of tensors."""
    text = exported.graph_module.print_readable(print_output=False) + str(
        exported.range_constraints
    )
    text += torch.__version__ + torch.backends.cpu.get_cpu_capability()  # its kernels' instructions
    constants = [
        (name, torch.as_tensor(value).numpy().tobytes())
        for name, value in exported.constants.items()
    ]
    folder = os.path.join(torch._inductor.runtime.cache_dir_utils.cache_dir(), "ddrl_steps")
    key = hashlib.sha256(text.encode() + repr(sorted(constants)).encode()).hexdigest()[:32]
    path = os.path.join(folder, f"{key}.pt2")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        temporary = tempfile.mkdtemp(dir=folder)  # then renamed: ranks compiling alike never clash
        built = torch._inductor.aoti_compile_and_package(
            exported, package_path=f"{temporary}/s.pt2"
        )
        os.replace(built, path)
        os.rmdir(temporary)
    runner = torch._inductor.aoti_load_package(path).loader
    return lambda inputs: runner.boxed_run(list(inputs))  # boxed_run empties the list it takes
