"""What the Python benchmarks say about the machine they ran on (every figure names its CPU)."""


def cpu_name():
    """The first `model name` of /proc/cpuinfo, or "unknown CPU"."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"
