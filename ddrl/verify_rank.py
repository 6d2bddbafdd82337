"""One rank of one of `python -m ddrl.verify`'s runs, in the process verify forked for it, and the
files verify's processes exchange, named in one place."""

import functools
import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddrl import in_sync, one_learner, training_state
from ddrl.failures import first_line

ITERATIONS = 3  # a coefficient set after an update, a schedule, running statistics all take part


class Stop(BaseException):
    """Ends a rank's main after its last iteration (main's own handlers let a BaseException by)."""


def load(script: Path):
    """The script as a module, without running its main (it runs only under `__main__`)."""
    name = "ddrl_verify_" + re.sub(r"\W", "_", script.stem)
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --- the rank --------------------------------------------------------------------------------
class Rank:
    """One rank of one of verify's runs: the script's main, its draws and minibatches recorded
    (allreduce) or replayed from the allreduce ranks', its training state recorded."""

    def __init__(self, role: str, rank: int, work: Path, precision: str):
        self.role = role
        self.rank = rank
        self.work = work
        self.precision = torch.float64 if precision == "float64" else torch.float32
        self.replays = None  # the allreduce ranks' draws, which the other runs take
        self.drawn = []  # this iteration's draws (allreduce ranks)
        self.draws = 0  # draws taken so far
        self.depth = 0  # a draw inside a draw (a transformed distribution's base) is part of it
        self.updates = 0
        self.pending = {}  # what the next record holds besides the state: the batch, the orders
        self.meta = {}

    def file(self, what: str | int) -> Path:
        return file_of(self.work, self.role, self.rank, what)

    def run(self, script: Path, flags: dict) -> int:
        """Main to its last recorded iteration (0), or what stopped it, in its end file (1)."""
        end = {"returned": True}
        try:
            module = load(script)
            os.chdir(self.work)  # a copy that changed folder at import writes nothing there
            torch.set_default_dtype(self.precision)
            if self.role != "allreduce":
                self.replays = [drawn_by(self.work, rank) for rank in (0, 1)]
            self.watch(module)
            module.main(module.Args(**flags))
        except Stop:
            end = self.meta.pop("said", {})
        except Exception as error:
            end = {"raised": f"{type(error).__name__}: {first_line(error)}"}
        sys.stdout.flush()
        sys.stderr.flush()
        self.file("end").write_text(json.dumps(end))
        return 1 if end else 0

    def watch(self, module) -> None:
        """Verify's hands on the run: every distribution's sample, the updates, the sync check."""
        classes = [torch.distributions.Distribution]
        while classes:
            kind = classes.pop()
            classes += kind.__subclasses__()
            for method in ("sample", "rsample"):
                if method in vars(kind):
                    setattr(kind, method, self.drawing(vars(kind)[method]))
        module.update = self.updating(module.update)
        one_learner.update_on_rank0 = self.gathering(one_learner.update_on_rank0)
        in_sync.check_in_sync = lambda iteration, unit, main, args, device: self.record(
            iteration, main, args
        )

    def drawing(self, method):
        @functools.wraps(method)
        def draw(distribution, *arguments, **options):
            self.depth += 1
            try:
                value = method(distribution, *arguments, **options)
            finally:
                self.depth -= 1
            return value if self.depth or value.is_meta else self.took(value)

        return draw

    def took(self, value: torch.Tensor) -> torch.Tensor:
        """A draw as this rank takes it: recorded (allreduce), or the allreduce ranks' draw of the
        same call where its shape fits (a probe's draws are no env's)."""
        index = self.draws
        self.draws += 1
        if self.replays is None:
            self.drawn.append(value.detach().cpu())
            return value
        if index >= len(self.replays[0]):
            return value
        theirs = [draws[index] for draws in self.replays]
        replay = theirs[self.rank] if self.role == "gather" else torch.cat(theirs)
        return replay.to(value) if replay.shape == value.shape else value

    def updating(self, update):
        """The script's update, its batch in this run's precision, its minibatches recorded
        (allreduce) or the union of the allreduce ranks' (the one-rank run's)."""
        signature = inspect.signature(update)

        def verify_update(*arguments, **options):
            bound = signature.bind(*arguments, **options)
            called = bound.arguments
            called["batch"].update(self.in_precision(called["batch"]))
            if self.role == "allreduce":
                self.updates += 1
                self.pending = {f"batch.{key}": value for key, value in called["batch"].items()}
                self.pending |= {key: called[key] for key in ("orders", "sizes") if key in called}
            elif self.role == "reference":
                self.updates += 1
                self.line_up(called)
            return update(*bound.args, **bound.kwargs)

        return verify_update

    def gathering(self, update_on_rank0):
        """one_learner.update_on_rank0 at the gather ranks, on the allreduce ranks' minibatches."""

        def verify_update_on_rank0(update_union, batch, orders=None, sizes=None):
            self.updates += 1
            if orders is not None:
                orders = read_record(self.work, "allreduce", self.rank, self.updates)["orders"]
            batch.update(self.in_precision(batch))
            return update_on_rank0(update_union, batch, orders, sizes)

        return verify_update_on_rank0

    def in_precision(self, batch: dict) -> dict:
        return {
            key: value.to(self.precision) if value.is_floating_point() else value
            for key, value in batch.items()
        }

    def line_up(self, called: dict) -> None:
        """The one-rank run's update at the allreduce ranks' minibatches: its batch paired unit by
        unit with the union of theirs, by the tensors both hold alike."""
        records = [read_record(self.work, "allreduce", rank, self.updates) for rank in (0, 1)]
        batch = {key: value.cpu() for key, value in called["batch"].items()}
        union = {key: torch.cat([r[f"batch.{key}"] for r in records]) for key in batch}
        units = called["orders"].shape[1] if "orders" in called else len(next(iter(batch.values())))
        scales = {key: value.double().abs().max().clamp(min=1e-30) for key, value in batch.items()}
        mine = units_of(batch, units, scales)
        theirs = units_of(union, units, scales)
        alike = [
            key for key in batch if mine and theirs and sorted(mine[key]) == sorted(theirs[key])
        ]
        if not alike:
            self.meta["said"] = {
                "said": "its batch holds other observations and actions than the two ranks' "
                "batches together (verify pairs each row, or each env's rows where the orders "
                "permute envs: the envs of rank r must be seeded as envs r x envs + j of one rank)"
            }
            raise Stop
        keys = sorted(alike) + sorted(set(batch) - set(alike))  # ties broken by the others
        place = np.empty(units, dtype=np.int64)
        place[sorted(range(units), key=lambda u: [theirs[k][u] for k in keys])] = sorted(
            range(units), key=lambda u: [mine[k][u] for k in keys]
        )
        self.meta["batch"] = batch_gaps(batch, union, place, units)
        if "orders" in called:
            sizes = records[0]["sizes"]
            orders = one_learner.union_orders([r["orders"] for r in records], sizes)
            called["orders"] = torch.as_tensor(place)[orders].to(called["orders"].device)
            called["sizes"] = sizes.sum(0)[None]

    def record(self, iteration: int, main, args) -> None:
        """The training state `main` holds after `iteration`, with its draws, batch and minibatches,
        in this rank's record; main stopped after the last."""
        state = training_state.found(main, args)
        names = list(state.tensors)
        tensors = {f"state.{i}": value for i, value in enumerate(state.tensors.values())}
        tensors |= {f"draw.{i}": value for i, value in enumerate(self.drawn)}
        tensors |= {f"gradient.{i}": state.gradients[n] for i, n in enumerate(names)
                    if state.gradients.get(n) is not None}  # fmt: skip
        ids = {id(tensor): name for name, tensor in state.tensors.items()}
        self.meta |= {"names": names, "numbers": state.numbers, "draws": len(self.drawn)}
        self.meta |= {"optimizers": list(state.optimizers), "stepped": [], "held": []}
        for index, optimizer in enumerate(state.optimizers.values()):
            self.meta["stepped"].append(training_state.STEPPED.get(optimizer, 0) > 0)
            held = [p for group in optimizer.param_groups for p in group["params"]]
            self.meta["held"].append([ids.get(id(p), "a parameter of no module") for p in held])
            for number, kept in optimizer.state_dict()["state"].items():
                tensors |= {f"optimizer.{index}.{number}.{key}": value for key, value in
                            kept.items() if isinstance(value, torch.Tensor)}  # fmt: skip
        tensors |= self.pending
        tensors = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}
        save_file(tensors, self.file(iteration), {"meta": json.dumps(self.meta)})
        self.drawn = []
        self.pending = {}
        self.meta = {}
        if iteration >= ITERATIONS:
            raise Stop


def drawn_by(work: Path, rank: int) -> list[torch.Tensor]:
    """An allreduce rank's draws in the order it took them, over every iteration it recorded."""
    records = [read_record(work, "allreduce", rank, i) for i in range(1, ITERATIONS + 1)]
    return [record[f"draw.{i}"] for record in records for i in range(record["meta"]["draws"])]


def units_of(batch: dict, units: int, scales: dict) -> dict[str, list[bytes]] | None:
    """Each tensor's units (rows, or `len // units` rows) as bytes, floats rounded to a millionth of
    their scale; None where a length is no multiple of the units."""
    if any(len(value) % units for value in batch.values()):
        return None
    found = {}
    for key, value in batch.items():
        value = value.reshape(units, -1)
        if value.is_floating_point():
            value = torch.round(value.double() / scales[key] * 2**20).long()
        found[key] = [row.tobytes() for row in value.numpy().view(np.uint8).reshape(units, -1)]
    return found


def batch_gaps(batch: dict, union: dict, place: np.ndarray, units: int) -> dict[str, list]:
    """Each floating tensor's largest relative gap between paired units, and whose unit it is."""
    gaps = {}
    for key, value in batch.items():
        if value.is_floating_point():
            mine = value.double().reshape(units, -1)[torch.as_tensor(place)]
            theirs = union[key].double().reshape(units, -1)
            gap = ((mine - theirs).abs() / (1 + theirs.abs())).amax(1)
            gaps[key] = [gap.max().item(), int(gap.argmax() >= units // 2)]
    return gaps


# --- the files the processes exchange -------------------------------------------------------------
def read_record(work: Path, role: str, rank: int, iteration: int) -> dict | None:
    """A rank's record of `iteration`: its tensors by key, and `meta`; None where it has none."""
    path = file_of(work, role, rank, iteration)
    if not path.exists():
        return None
    with safe_open(path, "pt") as file:
        record = {key: file.get_tensor(key) for key in file.keys()}
        return record | {"meta": json.loads(file.metadata()["meta"])}


def file_of(work: Path, role: str, rank: int, what: str | int) -> Path:
    """A rank's file of a run: its `log`, `end` (JSON) or record of an iteration (safetensors)."""
    suffix = ".safetensors" if isinstance(what, int) else ""
    return work / f"{role}.{rank}.{what}{suffix}"
