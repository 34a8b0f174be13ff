"""What the Python benchmarks share: the median time of a call, after one untimed call."""

import math
import statistics
import time


def median_seconds(repeats, body, min_sample_seconds=0.0):
    """The median over `repeats` samples of one call's time. A sample times enough calls in a row
    to last `min_sample_seconds` (counted from the untimed call), so that a short call's row does
    not swing with the timer and the scheduler's noise."""
    start = time.perf_counter()
    body()  # warm-up
    calls = max(1, math.ceil(min_sample_seconds / max(time.perf_counter() - start, 1e-9)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            body()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)
