"""The routers users would pick instead of Weir, each as faithful to its source as the
simulator's view of the fleet allows (see each module's docstring for the source)."""

from fleetsim.baselines.llmd_weighted import LlmdWeighted
from fleetsim.baselines.sglang_cache_aware import ApproximateRadixTree, SGLangCacheAware
from fleetsim.baselines.simple import LeastOutstanding, RoundRobin
from fleetsim.baselines.view import BaselineRouter, NoHealthyWorkerError, WorkerView, healthy

__all__ = [
    "ApproximateRadixTree",
    "BaselineRouter",
    "LeastOutstanding",
    "LlmdWeighted",
    "NoHealthyWorkerError",
    "RoundRobin",
    "SGLangCacheAware",
    "WorkerView",
    "healthy",
]
