"""Stand-in: tokamax's xprof-timed benchmarking is not available with the shim (see ../../__init__.py)."""


def compute_kernel_stats(*args, **kwargs):
    raise RuntimeError("xprof is not installed (bench/shims/xprof stands in for it): tokamax's xprof timing is "
                       "unavailable; use timing_method='wallclock' or install xprof")
