"""A stand-in for xprof (a 32 MB wheel with heavy dependencies) on the GPU machine.

tokamax 0.0.17 imports `xprof.cli.tools.get_kernel_stats_tool` when it loads, only for its own benchmarking
(`tokamax.benchmark` with timing by xprof). The zoo never calls that: its kernels run without it. Put this folder
on PYTHONPATH only where xprof is not installed (bench.run does); a real xprof always wins otherwise.
"""
