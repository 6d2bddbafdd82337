"""ddrl benchmarks, each `python -m benchmark.NAME --help`: run and plot (learning curves), interval (a final-return
cell), scaling and scaling_model (SPS against ranks), grad_sync (time per gradient sync), throughput (1-rank SPS beside
its bound and beside CleanRL's file, which cleanrl_compat runs), stragglers (a slow rank). Their results are in
benchmark/results/, each file headed by its command."""
