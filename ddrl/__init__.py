"""ddrl's runtime: what the scripts share and a researcher does not edit, in modules named for their
concern.

- run: `launch(args)`, and the Run whose calls are a run's life (start, resume, log, checkpoint,
finish)
- flags: the runtime's flags (`RuntimeArgs`, which every script's Args extends) and the rules beside
every flag
- failures: the one-line error (`fail`), warnings, NonFiniteError
- checks: what a run needs of this machine, the launchers' variables, agreement between the ranks
- launching: `--nprocs`, the launchers' variables, the process group, threads
- collectives: moving tensors between ranks, through MPI under mpirun, else torch.distributed
- run_folders: runs/NAME, created once, locked, never written through a link; its TensorBoard writer
- checkpoints: writing and reading checkpoints and model files
- stopping, preemption, progress: SIGTERM and Ctrl-C, DD-PPO's cut of the slowest rollouts, the
progress line
- rollout: the rollout's Agent, derived from the script's Agent (numpy versions of its methods) and
checked; tracing: the Agent's methods traced with torch.fx, as numpy programs; numpy_versions: the
numpy versions of the layers, functions and distributions an Agent calls
- one_learner: --sync gather, the script's own update run by rank 0 on the union of every rank's
batch
- evaluation: episodes played by the Agent, --eval-checkpoint
- env_support, cuda_graphs, machine: what env libraries need, Atari's acting step as CUDA graphs,
this machine
- verify: `python -m ddrl.verify SCRIPT`, a copy's update at 1 and 2 ranks compared

A script calls `ddrl.launch(args)` and the Run's methods, and the modules by name
(`collectives.allreduce_mean(...)`), so a reader sees at a glance which lines are the algorithm and
which are plumbing.
"""

from ddrl.run import Run, launch

__all__ = ["Run", "launch"]
