"""ddrl's runtime: what the scripts share and a researcher does not edit, in modules named for their concern.

- failures: the one-line error (`fail`), warnings, NonFiniteError
- checks: the flags every script shares, the machine a run needs, agreement between the rollout and the Agent, and
  between the ranks' weights
- launching: the Run record; `--nprocs`, the launchers' variables, the process group, threads
- collectives: moving tensors between ranks, through MPI under mpirun, else torch.distributed
- run_folders: runs/NAME, created once, and its TensorBoard writer
- checkpoints: writing and reading checkpoints and model files, resuming a run
- preemption: DD-PPO's cut of the slowest rollouts
- progress: sums over ranks, the progress line, the end of a run
- numpy_rollout: numpy copies of an Agent's modules, for the MLP scripts' rollouts
- envs: what env libraries need beside the algorithm (MuJoCo's console, Atari's evaluation protocol, a rendered frame)
- cuda_graphs: an acting step captured as CUDA graphs

The scripts import the modules by name (`from ddrl import checkpoints`) and call `checkpoints.save(...)`, so a reader
sees at a glance which lines are the algorithm and which are plumbing.
"""
