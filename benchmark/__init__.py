"""ddrl benchmarks, each `python -m benchmark.NAME --help`: run and plot (learning curves), scaling (SPS against ranks,
and its model at more ranks), grad_sync (time per gradient sync), throughput (the A/B runner: SPS beside its bound,
start-up and the weight check, beside another checkout and CleanRL's file), stragglers (a slow rank), atari_step (a
rollout step's parts), faults (killed and resized runs). Their results are in benchmark/results/, each headed by its
command."""
