"""The format of checkpoint and model files: safetensors and a JSON header, so nothing in a file can
run code; written atomically, and reading is checking, every misfit one line naming the fix."""

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
MAX_HEADER_BYTES = 16 * 2**20  # safetensors' header (its table and ours): ddrl writes a few KB
MAX_METADATA_CHARS = 2**20  # ddrl's JSON in it: args and optimizer options, a few KB at most
MAX_DEPTH = 8  # header, optimizers, one optimizer, its groups, a group, a tuple
# torch.get_rng_state()'s struct (at::CPUGeneratorImplState), as torch's set_state takes states no
# generator leaves (a key of zeros, a NaN cached, a position past the key)
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
    "rng.numpy_state": (torch.float64, (3,)),  # position, has_gauss, cached gaussian
    "rng.torch": (torch.uint8, (TORCH_STATE.itemsize,)),
}
MT_WORDS = 624  # a Mersenne Twister's key, 32-bit words; its position lies in [0, 624]
MAX_GAUSSIAN = 16.0  # a cached gaussian is below 12.1 in size (numpy's polar method): none beyond
STREAM_ROWS = 256  # ranks' streams checked at once: memory bounded, whatever world a file claims
HEADER_TYPES = {"kind": str, "script": str, "algorithm": str, "env_id": str, "args": dict}


# --- writing: a file atomically, with its header, optimizers and random streams -------------------
def write(
    path: str,
    args,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer] | None = None,
    streams: list[dict[str, torch.Tensor]] | None = None,
    **fields,
) -> str:
    """A training checkpoint (with `optimizers` and every rank's `streams`) or a model file, its
    header saying who wrote it, the env, the args and `fields`; '' once written, else why not."""
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
    """`tensors` and `header` as one file at `path`, through a new file beside it that takes its
    place: a kill leaves the old file, a failure no part. '' once written, else why not."""
    folder = os.path.dirname(path) or "."
    temporary = ""
    try:
        on_host = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        data = save_bytes(on_host, metadata={FORMAT: json.dumps(header, default=repr)})
        descriptor, temporary = tempfile.mkstemp(
            dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
        )
        os.fchmod(descriptor, 0o644)  # readable as a file open() makes, not mkstemp's owner-only
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
        temporary = ""
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
    """An optimizer's tensors as NAME.state.INDEX.KEY, and its type, options and numbers."""
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
    """This process's random streams as tensors: Python's, numpy's, torch's (and CUDA's in use)."""
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
    """The header of the file at `path` and its tensors' (shape, dtype) by name, read without any
    tensor and within bounds; anything else is one line naming the file, what it is and `fix`."""
    if problem := file_problem(path):
        fail(f"{path} {problem}; {fix}")
    try:
        with safe_open(path, framework="pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {}
            for name in opened.keys():
                declared = opened.get_slice(name)
                tensors[name] = (tuple(declared.get_shape()), declared.get_dtype())
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
    for key, kind in HEADER_TYPES.items():
        if not isinstance(header.get(key), kind):
            found = type(header[key]).__name__ if key in header else "nothing"
            fail(
                f"{path} holds {found} as its {key!r}, where ddrl writes a {kind.__name__}: it is "
                f"damaged; {fix}"
            )
    return header, tensors


def file_problem(path: str) -> str | None:
    """What makes `path` no safetensors file, from its type and first 8 bytes; None if none."""
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
    """Stop in one line unless the checkpoint holds every rank's random streams, each a state its
    generator leaves (their setters take most others)."""
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
    """(ranks, what a message says) for each state no generator leaves in `rows` (a rank each)."""
    python = rows["rng.python"]
    gauss = rows["rng.python_gauss"]
    position, has_gauss, cached = rows["rng.numpy_state"].T
    faults = mersenne_faults("Python's", python[:, :MT_WORDS], python[:, MT_WORDS])
    faults.append((np.abs(gauss) > MAX_GAUSSIAN, "Python's cached gaussian is no draw's"))
    faults += mersenne_faults("numpy's", rows["rng.numpy"], position)
    faults.append((~np.isin(has_gauss, (0, 1)), "numpy's has_gauss is neither 0 nor 1"))
    faults.append((~(np.abs(cached) <= MAX_GAUSSIAN), "numpy's cached gaussian is no draw's"))
    faults += torch_faults(rows["rng.torch"])
    if "rng.cuda" in rows:
        offsets = rows["rng.cuda"][..., 8:16].copy().view("<i8")[..., 0]
        wrong = ((offsets < 0) | (offsets % 4 != 0)).any(axis=1)
        faults.append((wrong, "CUDA's offset is negative or no multiple of 4"))
    return faults


def torch_faults(states: np.ndarray) -> list[tuple[np.ndarray, str]]:
    """stream_faults' of torch's CPU generator: a position, key or cached normals no draw leaves."""
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
    """stream_faults' of a Mersenne Twister's `key` and `position`: words no 32-bit number, a
    position outside the key, and 19937 bits of zeros (no seeding leaves them)."""
    outside = ((key < 0) | (key >= 2**32)).any(axis=1)
    zeros = (key[:, 0] % 2**32 < 2**31) & ~key[:, 1:].any(axis=1)
    faults = [(outside, f"{name} key holds numbers outside [0, 2**32)")]
    if position is not None:
        placed = (position >= 0) & (position <= MT_WORDS) & (position == np.floor(position))
        faults.append((~placed, f"{name} position lies outside [0, {MT_WORDS}]"))
    faults.append((zeros, f"{name} key is zeros, from which it would draw nothing but zeros"))
    return faults


def restore_random_streams(path: str, found: dict, rank: int) -> None:
    """This process's random streams set to rank `rank`'s in the file; a refusal is one line."""
    cuda = ["rng.cuda"] if "rng.cuda" in found and torch.cuda.is_available() else []
    names = [*RANDOM_STREAMS, *cuda]
    # copies: torch.set_rng_state misreads a view into the stacked ranks' states
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
    """The first few differences between the file's tensors named `prefix`... and those `wanted`
    ((shape, torch dtype) by name), as a message lists them; '' if none."""
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
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
    }
    return names.get(dtype, "BOOL" if dtype == torch.bool else str(dtype))


def load(path: str, names: list[str], fix: str) -> dict[str, torch.Tensor]:
    """The named tensors of the file, or one line naming those that hold NaN or infinity."""
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
    """The named tensors of the file at `path`, or their `rows` alone."""
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
