"""The full suite's fixtures and helpers (tests/helpers.py, which test_scripts.py imports too), and
one line at the end of a run that skipped tests for want of root, `ip`, `tc` or SLURM."""
from helpers import *   # noqa: F401,F403  (pytest finds the fixtures among this module's names)
from helpers import NO_CLUSTER, NO_SLURM


def pytest_terminal_summary(terminalreporter):
    skipped = [report for report in terminalreporter.stats.get("skipped", [])
               if any(str(reason) in str(report.longrepr) for reason in (NO_CLUSTER, NO_SLURM) if reason)]
    if skipped:
        why = "; ".join(str(reason) for reason in dict.fromkeys((NO_CLUSTER, NO_SLURM)) if reason)
        terminalreporter.write_line(
            f"{len(skipped)} tests of several machines were skipped ({why}): as root, "
            f"`apt-get install iproute2 ethtool slurm-wlm munge` and run again (.ci/run does)", yellow=True)
