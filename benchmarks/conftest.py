"""Collect the benchmark modules (named bench_*.py) when pytest is pointed at benchmarks/."""


def pytest_configure(config):
    config.addinivalue_line("python_files", "bench_*.py")
