"""The whole operator sweep (scripts/sweep.sh): sc_sweep with two calls per overload."""
import sc_sweep
from sc_sweep import TOL, judge, reference, run_torch  # noqa: F401 - the scenario's interface


def cases(world):
    return sc_sweep.cases(world, per_overload=2)
