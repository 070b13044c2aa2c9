"""The offline half: profiles (thresholds, transforms), the profiler and the oaken-plus search."""
