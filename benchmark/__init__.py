"""ddrl benchmarks: learning curves, scaling, gradient-sync cost and throughput, reproducible from the command line.

    python -m benchmark.run --help        # launch a script over env ids and seeds under torchrun
    python -m benchmark.plot --help       # learning curves (PNG) and final-return table (markdown)
    python -m benchmark.scaling --help    # SPS against number of ranks, with the time split per iteration
    python -m benchmark.grad_sync --help  # time per gradient sync: per-parameter, flat, DDP, gather+broadcast
    python -m benchmark.throughput --help # 1-rank SPS beside the env-only rate or the fp32 compute limit
    python -m benchmark.stragglers --help # SPS with a slow rank: waiting for it against --preempt-fraction

Results produced on a 2-core CPU machine live in benchmark/results/, each file headed by its command.
"""
