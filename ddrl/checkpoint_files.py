"""The format of ddrl's checkpoint and model files: one safetensors file of tensors (model.NAME, an
optimizer's NAME.state.INDEX.KEY, every rank's random streams as rng.*) and a small JSON header
saying what wrote them, so nothing in a file can run code, and every tensor's dtype, shape and bytes
are declared before any is read. Writing one is atomic; reading one is checking it: the file, its
header within the bounds of what ddrl writes, every tensor against what is wanted, every number
finite, every random stream a state its generator leaves; every misfit is one line that names the
file and the fix, with any text the file holds shown escaped. Nothing here knows of a run. The
calls: `write`; `read` (the header, and the tensors' shapes and dtypes), `misfits` (those against
what is wanted) and `load` (tensors, found finite); every rank's random streams, `random_streams`
(this process's), `check_random_streams` and `restore_random_streams`."""

from __future__ import annotations

import json
import os
import random
import stat
import sys
import tempfile
from dataclasses import asdict

import numpy as np
import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_bytes

from ddrl import failures
from ddrl.failures import fail, first_line, shown

FORMAT = "ddrl"  # the header's one metadata entry, a JSON object; its "format" is this too
VERSION = 2
# safetensors' own header (the tensors' table and ours): ddrl's files hold a few hundred tensors, a
# few KB of table; a network of ten thousand parameters' tensors would take about 3 MB. A file
# declaring more is refused, unread.
MAX_HEADER_BYTES = 16 * 2**20
MAX_METADATA_CHARS = 2**20  # ddrl's JSON in it: args and optimizer options, a few KB at most
# how deep ddrl's JSON nests: header, optimizers, one optimizer, its groups, a group, a tuple
MAX_DEPTH = 8
# torch's CPU generator state as torch.get_rng_state() returns it (at::CPUGeneratorImplState): the
# fields ddrl checks, where the struct lays them out. torch's own set_state checks only its size,
# `seeded`, and `left` and `next` one by one: it takes a key of zeros, a NaN cached, and a position
# from which the next draw reads past the key.
TORCH_STATE = np.dtype(
    {
        "names": "left seeded next key normal normal_valid float_normal float_valid".split(),
        "formats": ["<i4", "<i4", "<u8", ("<u8", (624,)), "<f8", "<i4", "<f4", "u1"],
        "offsets": [8, 12, 16, 24, 5024, 5040, 5048, 5052],
        "itemsize": 5056,
    }
)
RANDOM_STREAMS = {  # the tensors of every rank's random streams: name, dtype, shape after the ranks
    "rng.python": (torch.int64, (625,)),  # Python's Mersenne Twister: its 624 words and position
    "rng.python_gauss": (torch.float64, ()),  # its cached gaussian, NaN where none
    "rng.numpy": (torch.int64, (624,)),  # numpy's legacy generator: its key
    # its position, whether a gaussian is cached, that gaussian
    "rng.numpy_state": (torch.float64, (3,)),
    "rng.torch": (torch.uint8, (TORCH_STATE.itemsize,)),
}
MT_WORDS = 624  # a Mersenne Twister's key, 32-bit words; its position lies in [0, 624]
# a gaussian a generator caches is below 12.1 in size (numpy's polar method on 53-bit uniforms;
# Python's and torch's Box-Muller: 8.6): one beyond this no draw gave
MAX_GAUSSIAN = 16.0
STREAM_ROWS = 256  # ranks' streams checked at once: memory bounded, whatever world a file claims


# --- writing: a file atomically, with its header, optimizers and random streams -------------------
def write(
    path: str,
    args,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    streams: list[dict[str, torch.Tensor]] | None = None,
    **fields,
) -> str:
    """A training checkpoint (`model`'s state, `optimizers`' per-parameter state by name, every
    rank's random streams, rank 0's first) or, without optimizers, a model file, written at `path`
    atomically (write_atomically); its header says what the file is, which script and algorithm
    wrote it (a copy of a script loads the original's file where its Agent fits, and says whose it
    is), the env, the args and `fields`. Returns '' once written, else why not."""
    writer = sys.modules.get(type(model).__module__)
    algorithm = ((writer.__doc__ or "").strip().splitlines() or [""])[0] if writer else ""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "model" if optimizers is None else "training",
        "script": failures.script,
        "algorithm": algorithm,
        "env_id": args.env_id,
        "args": asdict(args),
        **fields,
    }
    tensors = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    if optimizers is not None:
        header["optimizers"] = {}
        for name, optimizer in optimizers.items():
            entries, header["optimizers"][name] = optimizer_entries(name, optimizer)
            tensors |= entries
    if streams:
        tensors |= {name: torch.stack([rank[name] for rank in streams]) for name in streams[0]}
    return write_atomically(path, tensors, header)


def write_atomically(path: str, tensors: dict[str, torch.Tensor], header: dict) -> str:
    """`tensors` and the JSON `header` as one safetensors file at `path`, in its existing folder,
    atomically: the bytes go to a new file made exclusively beside it, which then takes `path`'s
    place (a link there is replaced, not followed). A kill at any moment leaves the old file; a
    failed write leaves no part behind. Returns '' once written, else why not, in words that name
    the fix: the caller stops every rank with it, as only this rank knows."""
    folder = os.path.dirname(path) or "."
    temporary = ""
    try:
        on_host = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        # tuples as lists, anything else JSON cannot hold (a tensor learning rate) as its repr
        data = save_bytes(on_host, metadata={FORMAT: json.dumps(header, default=repr)})
        descriptor, temporary = tempfile.mkstemp(
            dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
        )
        os.fchmod(descriptor, 0o644)  # readable as a file open() makes, not mkstemp's owner-only
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
        temporary = ""
    # a full disk, a folder made unwritable, a folder where the file goes
    except (OSError, RuntimeError, SafetensorError) as error:
        return (
            f"could not write {path} ({first_line(error)}): free disk space or make the folder "
            "writable"
        )
    finally:
        if temporary and os.path.lexists(temporary):
            os.remove(temporary)
    return ""


def optimizer_entries(
    name: str, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer's per-parameter state, as torch's state_dict numbers it (INDEX: the parameter's
    place across the groups), as tensors named NAME.state.INDEX.KEY, and what the header says of it:
    its type, its options, and the per-parameter numbers that are no tensors."""
    state = optimizer.state_dict()
    tensors = {}
    numbers = {}
    for index, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{name}.state.{index}.{key}"] = value
            else:
                numbers[f"{index}.{key}"] = value
    groups = [
        {key: value for key, value in group.items() if key != "params"}
        for group in state["param_groups"]
    ]
    return tensors, {"type": type(optimizer).__name__, "param_groups": groups, "numbers": numbers}


def random_streams() -> dict[str, torch.Tensor]:
    """This process's random streams as tensors: Python's, numpy's, torch's CPU generator (CUDA's
    with it where CUDA is in use)."""
    _, python_state, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    streams = {
        "rng.python": torch.tensor(python_state, dtype=torch.int64),
        "rng.python_gauss": torch.tensor(
            float("nan") if gauss is None else gauss, dtype=torch.float64
        ),
        "rng.numpy": torch.from_numpy(keys.astype(np.int64)),
        "rng.numpy_state": torch.tensor([position, has_gauss, cached], dtype=torch.float64),
        "rng.torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        streams["rng.cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return streams


# --- reading: the file, then its header, each refused in one line ---------------------------------
def read(path: str, fix: str) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]]]:
    """The header of the checkpoint or model file at `path` and its tensors' (shape, dtype) by name,
    read without loading any tensor: only a regular file, whose first 8 bytes declare a header
    within MAX_HEADER_BYTES and within the file, which safetensors then checks (every tensor's bytes
    inside the file, none overlapping); ddrl's JSON in it within MAX_METADATA_CHARS and MAX_DEPTH.
    Anything else is one line naming the file, what it is and `fix`."""
    if problem := file_problem(path):
        fail(f"{path} {problem}; {fix}")
    try:
        with safe_open(path, framework="pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {}
            for name in opened.keys():
                declared = opened.get_slice(name)
                tensors[name] = (tuple(declared.get_shape()), declared.get_dtype())
    # safetensors' checks, or the OS refusing to map it (a huge sparse file)
    except Exception as error:
        fail(
            f"{path} could not be opened as a safetensors file ({type(error).__name__}: "
            f"{first_line(error)}): it is truncated, no safetensors file, or larger than this "
            f"machine can map; {fix}"
        )
    text = metadata.get(FORMAT) if isinstance(metadata, dict) else None
    if not isinstance(text, str):
        fail(
            f"{path} is a safetensors file without ddrl's header: it is no checkpoint of a ddrl "
            f"script; {fix}"
        )
    if len(text) > MAX_METADATA_CHARS:
        fail(
            f"{path} holds a header of {len(text):,} characters, more than ddrl writes "
            f"({MAX_METADATA_CHARS:,}); {fix}"
        )
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as error:
        fail(f"{path} holds a header that is no JSON ddrl writes ({type(error).__name__}); {fix}")
    if depth(header) > MAX_DEPTH:
        fail(f"{path} holds a header nested deeper than ddrl writes ({MAX_DEPTH} levels); {fix}")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = (
            f"of format {shown(header.get('format'))}"
            if isinstance(header, dict)
            else "that is no JSON object"
        )
        fail(
            f"{path} holds a header {found}, not ddrl's: it is no checkpoint of a ddrl script; "
            f"{fix}"
        )
    if header.get("version") != VERSION:
        fail(
            f"{path} holds a header of ddrl's format version {shown(header.get('version'))}, not "
            f"{VERSION}: use the ddrl that wrote it"
        )
    for key, kind in {
        "kind": str,
        "script": str,
        "algorithm": str,
        "env_id": str,
        "args": dict,
    }.items():
        if not isinstance(header.get(key), kind):
            found = type(header[key]).__name__ if key in header else "nothing"
            fail(
                f"{path} holds {found} as its {key!r}, where ddrl writes a {kind.__name__}: it is "
                f"damaged; {fix}"
            )
    return header, tensors


def file_problem(path: str) -> str | None:
    """What makes `path` no safetensors file, found from its type and first 8 bytes at most: not a
    regular file (a folder, a device, a named pipe), too short, a header longer than the bound or
    the file, an earlier version's torch.save zip archive, a pickle. None if safetensors may open
    it."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            return "is a folder"
        if not stat.S_ISREG(mode):
            kinds = {
                stat.S_ISCHR: "character device",
                stat.S_ISBLK: "block device",
                stat.S_ISFIFO: "named pipe",
            }
            kind = next((name for test, name in kinds.items() if test(mode)), "socket")
            return f"is a {kind}, not a file: refused, unread"
        size = os.path.getsize(path)
        with open(path, "rb") as file:
            first = file.read(8)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    declared = int.from_bytes(first, "little")
    fits = len(first) == 8 and declared <= MAX_HEADER_BYTES and 8 + declared <= size
    if first.startswith(b"PK\x03\x04") and not fits:
        return (
            "is a zip archive, as torch.save wrote an earlier version's checkpoints (.pt), which "
            "this version does not read (they need pickle, which can run code): resume or "
            "evaluate it with the version that wrote it"
        )
    # a header's length may begin with 0x80 too: 384, 640, ... bytes
    if first[:1] == b"\x80" and not fits:
        return "is a pickle, which can run code: refused, unread"
    if len(first) < 8:
        return (
            f"is {size} bytes long, too short for a safetensors header: it is truncated or no "
            "checkpoint"
        )
    if not fits:
        bound = (
            f"more than the {MAX_HEADER_BYTES:,} bytes ddrl writes"
            if declared > MAX_HEADER_BYTES
            else "more than it holds"
        )
        return (
            f"declares a header of {declared:,} bytes, {bound}: it is truncated or no checkpoint; "
            "refused, unread"
        )
    return None


def depth(value) -> int:
    """How deep JSON `value` nests (a number or string: 0), found without recursion."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            pending.extend(
                (child, level + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return deepest


# --- every rank's random streams: states their generators leave -----------------------------------
def check_random_streams(path: str, header: dict, found: dict) -> None:
    """Stop in one line naming the file, the rank and the stream unless the checkpoint holds every
    rank's random streams (Python's, numpy's, torch's, CUDA's where it has them) in the shapes its
    world gives, each a state its generator leaves: a key that is no zeros, a position within it, a
    cached gaussian that a draw gives. numpy resumed from a key of zeros would hang in its next
    gaussian; a NaN cached would reach the first actions. The generators' own setters take most of
    these (numpy's any position, from which its next draw reads outside the key), so they are
    checked here. Read STREAM_ROWS ranks at a time."""
    world_size = header["world_size"]
    wanted = {
        name: ((world_size, *shape), dtype) for name, (dtype, shape) in RANDOM_STREAMS.items()
    }
    faults = misfits({name: found[name] for name in wanted if name in found}, wanted, "")
    cuda_shape, cuda_dtype = found.get("rng.cuda", ((world_size, 1, 16), "U8"))
    if not faults and (
        len(cuda_shape) != 3 or cuda_shape[::2] != (world_size, 16) or cuda_dtype != "U8"
    ):
        faults = f"rng.cuda {cuda_shape} {shown(cuda_dtype)}, not ({world_size}, devices, 16) U8"
    if faults:
        fail(
            f"{path}: its random streams do not fit its {world_size} ranks ({faults}); delete it "
            "to resume from the one before"
        )
    names = [*wanted, *(["rng.cuda"] if "rng.cuda" in found else [])]
    for first in range(0, world_size, STREAM_ROWS):
        rows = {
            name: tensor.numpy()
            for name, tensor in tensors_of(path, names, slice(first, first + STREAM_ROWS)).items()
        }
        for ranks, fault in stream_faults(rows):
            if ranks.any():
                fail(
                    f"{path}: its random streams of rank {first + int(ranks.argmax())} do not fit "
                    f"this run ({fault}), a state no generator leaves: it is damaged; delete it to "
                    "resume from the one before"
                )


def stream_faults(rows: dict[str, np.ndarray]) -> list[tuple[np.ndarray, str]]:
    """Each way the ranks' random streams in `rows` (a row a rank) can hold a state no generator
    leaves: which rows do, and what a message says of it."""
    python = rows["rng.python"]
    gauss = rows["rng.python_gauss"]
    position, has_gauss, cached = rows["rng.numpy_state"].T
    faults = mersenne_faults("Python's", python[:, :MT_WORDS], python[:, MT_WORDS])
    # NaN: none cached, as the file writes Python's None
    faults.append((np.abs(gauss) > MAX_GAUSSIAN, "Python's cached gaussian is no draw's"))
    faults += mersenne_faults("numpy's", rows["rng.numpy"], position)
    faults.append((~np.isin(has_gauss, (0, 1)), "numpy's has_gauss is neither 0 nor 1"))
    faults.append((~(np.abs(cached) <= MAX_GAUSSIAN), "numpy's cached gaussian is no draw's"))
    faults += torch_faults(rows["rng.torch"])
    if "rng.cuda" in rows:
        offsets = rows["rng.cuda"][..., 8:16].copy().view("<i8")[..., 0]
        # CUDA's Philox offset: torch refuses one that is no multiple of 4, and never counts back
        wrong = ((offsets < 0) | (offsets % 4 != 0)).any(axis=1)
        faults.append((wrong, "CUDA's offset is negative or no multiple of 4"))
    return faults


def torch_faults(states: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """stream_faults' of torch's CPU generator states (a row of its bytes a rank, TORCH_STATE):
    its key as mersenne_faults checks it, a generator never seeded, a position past the key's end
    (`left` words to draw from `next` on: a seeded generator has left 1 and next 0, and from its
    first draw on left + next is 625), and cached normals no draw gives."""
    fields = states.view(TORCH_STATE)[:, 0]
    left = fields["left"].astype(np.int64)
    after = left + fields["next"].astype(np.float64)
    placed = (left >= 1) & (left <= MT_WORDS) & (fields["next"] <= MT_WORDS)
    faults = [(fields["seeded"] != 1, "torch's generator was never seeded")]
    faults.append((~(placed & (after <= MT_WORDS + 1)), "torch's position lies outside its key"))
    faults += mersenne_faults("torch's", fields["key"], None)
    for cached, valid in (("normal", "normal_valid"), ("float_normal", "float_valid")):
        size = np.abs(fields[cached].astype(np.float64))
        wrong = ~np.isin(fields[valid], (0, 1)) | ((fields[valid] == 1) & ~(size <= MAX_GAUSSIAN))
        faults.append((wrong, f"torch's cached {cached.replace('_', ' ')} is no draw's"))
    return faults


def mersenne_faults(
    name: str, key: np.ndarray, position: np.ndarray | None
) -> list[tuple[np.ndarray, str]]:
    """stream_faults' of a Mersenne Twister's `key` (a row of 624 words a rank) and `position`
    (None: the caller checks it): words that are no 32-bit numbers (Python's and torch's generators
    would cut them), a position outside the key, and a key whose 19937 bits (the first word's top
    bit, the other words) are zeros, which no seeding leaves and from which the generator draws
    zeros forever."""
    outside = ((key < 0) | (key >= 2**32)).any(axis=1)
    zeros = (key[:, 0] % 2**32 < 2**31) & ~key[:, 1:].any(axis=1)
    faults = [(outside, f"{name} key holds numbers outside [0, 2**32)")]
    if position is not None:
        placed = (position >= 0) & (position <= MT_WORDS) & (position == np.floor(position))
        faults.append((~placed, f"{name} position lies outside [0, {MT_WORDS}]"))
    faults.append((zeros, f"{name} key is zeros, from which it would draw nothing but zeros"))
    return faults


def restore_random_streams(path: str, found: dict, rank: int) -> None:
    """This process's random streams set to the ones rank `rank` (one of the file's ranks) left in
    the file at `path` (`found`: read's tensors of it), whose streams check_random_streams found
    states their generators leave; what a generator still refuses is one line."""
    cuda = ["rng.cuda"] if "rng.cuda" in found and torch.cuda.is_available() else []
    names = [*RANDOM_STREAMS, *cuda]
    # copies: torch.set_rng_state misreads a view into the stacked ranks' states (rank r's starts
    # past offset 0)
    streams = {
        name: rows[0].clone()
        for name, rows in tensors_of(path, names, slice(rank, rank + 1)).items()
    }
    try:
        python_state = tuple(int(word) for word in streams["rng.python"])
        gauss = float(streams["rng.python_gauss"])
        random.setstate((3, python_state, None if np.isnan(gauss) else gauss))
        position, has_gauss, cached = streams["rng.numpy_state"].tolist()
        keys = streams["rng.numpy"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(position), int(has_gauss), cached))
        torch.set_rng_state(streams["rng.torch"])
        if "rng.cuda" in streams:
            # the GPUs both machines have: a rank uses one, cuda:LOCAL_RANK
            devices = torch.cuda.device_count()
            torch.cuda.set_rng_state_all([state.clone() for state in streams["rng.cuda"][:devices]])
    except (LookupError, TypeError, ValueError, OverflowError, RuntimeError) as error:
        fail(
            f"{path}: its random streams of rank {rank} do not fit this run "
            f"({first_line(error)}); delete it to resume from the one before",
            any_rank=True,  # this rank's alone: rank 0 may have loaded its own
        )


# --- tensors: compared with what is wanted, then loaded -------------------------------------------
def misfits(found: dict[str, tuple], wanted: dict[str, tuple], prefix: str) -> str:
    """The first few differences between the file's tensors named `prefix`... and the ones `wanted`
    (name: (shape, torch dtype)), as a message lists them, the file's names escaped; '' if none."""
    faults = []
    for name, (shape, dtype) in wanted.items():
        if name not in found:
            faults.append(f"{name.removeprefix(prefix)} missing")
        elif found[name][0] != shape:
            faults.append(f"{name.removeprefix(prefix)} {found[name][0]}, not {shape}")
        elif found[name][1] != safetensors_dtype(dtype):
            faults.append(
                f"{name.removeprefix(prefix)} {shown(found[name][1])}, not "
                f"{safetensors_dtype(dtype)}"
            )
    faults += [
        f"{shown(name.removeprefix(prefix))} unknown"
        for name in found
        if name.startswith(prefix) and name not in wanted
    ]
    return ", ".join(faults[:3]) + (", ..." if len(faults) > 3 else "")


def safetensors_dtype(dtype: torch.dtype) -> str:
    """torch's dtype as safetensors names it (F32, F64, I64, U8, BOOL, ...)."""
    names = {
        torch.float32: "F32",
        torch.float64: "F64",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
    }
    names |= {
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
    }
    return names.get(dtype, "BOOL" if dtype == torch.bool else str(dtype))


def load(path: str, names: list[str], fix: str) -> dict[str, torch.Tensor]:
    """The named tensors of the file at `path` (which misfits found as wanted), or one line naming
    the file, its first tensors that hold NaN or infinity, and `fix`."""
    tensors = tensors_of(path, names)
    nonfinite = [
        name
        for name, value in tensors.items()
        if value.is_floating_point() and not value.isfinite().all()
    ]
    if nonfinite:
        fail(
            f"{path}: its {', '.join(shown(name) for name in nonfinite[:3])} hold(s) NaN or "
            f"infinity; {fix}"
        )
    return tensors


def tensors_of(path: str, names: list[str], rows: slice | None = None) -> dict[str, torch.Tensor]:
    """The named tensors of the file at `path` (found before, with the shapes and dtypes wanted), or
    their `rows` alone, read without the rest."""
    try:
        with safe_open(path, framework="pt") as opened:
            return {
                name: opened.get_tensor(name) if rows is None else opened.get_slice(name)[rows]
                for name in names
            }
    except Exception as error:  # the file changed since it was checked, or the OS refused to map it
        fail(
            f"{path} could not be read ({type(error).__name__}: {first_line(error)}); use a "
            "checkpoint from before"
        )
