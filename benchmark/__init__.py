"""ddrl benchmarks, each `python -m benchmark.NAME --help`: run and plot (learning curves), interval (a final-return
cell from per-seed values), scaling and scaling_model (SPS against ranks), grad_sync (time per gradient sync),
throughput (1-rank SPS beside its bound), stragglers (a slow rank: waiting or preempting). Results produced on a
2-core CPU machine live in benchmark/results/, each file headed by its command.
"""
