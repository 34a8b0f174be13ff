"""What the Python benchmarks share: the median time of a call, after one untimed call."""

import statistics
import time


def median_seconds(repeats, body):
    body()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        body()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
