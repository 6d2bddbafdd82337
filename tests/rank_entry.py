"""Run one rank of a ddrl script, then save that rank's trained parameters to ./rank{RANK}.pt.

Usage (under torchrun): rank_entry.py SCRIPT.py [script flags...]. Tests use it to check that every
rank ends training with the same weights.
"""

import importlib
import os
import sys
from pathlib import Path

import torch
import tyro

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    module = importlib.import_module(Path(sys.argv[1]).stem)
    agent = module.main(tyro.cli(module.Args, args=sys.argv[2:]))
    torch.save(agent.state_dict(), f"rank{os.environ['RANK']}.pt")
