"""Random fuzz rounds of test_fuzz.py's generators for a time budget each (not derandomized: new
examples every run), to look for failures the derandomized tests do not reach.

    TRITON_INTERPRET=1 python tests/fuzz_campaign.py --seconds 240 --targets triton,tiles,kv
    python tests/fuzz_campaign.py --seconds 300 --targets gluon,kv_gpu   # on a GPU (sm90)
    python tests/fuzz_campaign.py --seconds 300 --targets gpu_large,gpu_features,gluon_large   # on a GPU

Prints, per target, the examples run or the first failure (hypothesis shrinks it and prints the
call).  A failure found here belongs in test_fuzz.py as an ``@example``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_fuzz as T  # noqa: E402


def _gpu_target(problems, backends=T.GPU_BACKENDS):
    """(backend, problem) pairs over ``backends`` (every GPU backend), checked as test_fuzz_gpu checks one."""
    return st.tuples(st.sampled_from(backends), problems), lambda bf: T.fuzz_gpu_one(*bf)


# the gpu_* targets' problems, drawn with a backend among test_fuzz's GPU_BACKENDS (or --gpu-backends)
GPU_PROBLEMS = {
    "gpu_large": T.problems(scales=(None, 0.05, 1.0, 3.0, 20.0), magnitudes=(4.0, 8.0), head_dims=T.GPU_HEAD_DIMS),
    "gpu_features": T.problems(
        scales=(None, 0.05, 1.0), magnitudes=(1.0, 8.0), features=True, head_dims=T.GPU_HEAD_DIMS
    ),
    "gpu_layouts": T.problems(
        scales=(None, 0.05, 1.0), magnitudes=(1.0,), features=True, head_dims=T.GPU_HEAD_DIMS, layouts=True
    ),
}

TARGETS = {
    # name: (generator, check of one example)
    "triton": (
        T.problems(scales=(None, 1e-4, 0.05, 1.0, 3.0, 20.0), magnitudes=(1.0, 8.0)),
        functools.partial(T.fuzz_one, "triton"),
    ),
    "tiles": (
        T.problems(scales=(None, 0.05, 1.0), magnitudes=(1.0,), features=True, lengths=T.TILE_LENGTHS),
        functools.partial(T.fuzz_one, "triton"),
    ),
    "features": (
        T.problems(scales=(None, 0.05, 1.0), magnitudes=(1.0, 8.0), features=True),
        functools.partial(T.fuzz_one, "triton"),
    ),
    "kv": (
        T.kv_problems(dtypes=(torch.float32, torch.float16), head_dims=(16, 33)),
        lambda p: T.test_fuzz_kvcache.hypothesis.inner_test("triton", p),
    ),
    "layouts": (
        T.problems(scales=(None, 0.05, 1.0), magnitudes=(1.0, 8.0), features=True, layouts=True),
        functools.partial(T.fuzz_one, "triton"),
    ),
    "kv_layouts": (
        T.kv_problems(dtypes=(torch.float32, torch.float16), head_dims=(16, 33), layouts=True),
        lambda p: T.test_fuzz_kvcache.hypothesis.inner_test("triton", p),
    ),
    "decode": (T.decode_problems(), lambda p: T.test_fuzz_triton_decode_route.hypothesis.inner_test(p)),
    "math": (T.problems(features=True), functools.partial(T.fuzz_one, "math")),
    "torch_cpu": (T.problems(), functools.partial(T.fuzz_one, "torch_cpu")),
    "gluon": (T.gluon_problems(), T.gluon_differential),
    # large scores (magnitude 4-8 scales q and k: scores in the tens to hundreds) where test_fuzz keeps 1
    "gluon_large": (T.gluon_problems(magnitudes=(4.0, 8.0)), T.gluon_differential),
    "kv_gpu_layouts": (
        T.kv_problems(
            dtypes=(torch.float16, torch.bfloat16),
            head_dims=(64, 128),
            sqs=(1, 2, 16, 128, 256, 0),
            layouts=True,
        ),
        lambda p: T.test_fuzz_kvcache_gpu.hypothesis.inner_test("triton", p),
    ),
    "kv_gpu": (
        T.kv_problems(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            head_dims=(16, 64, 128),
            sqs=(1, 2, 5, 16, 65, 128, 130, 256, 0),
        ),
        lambda p: T.test_fuzz_kvcache_gpu.hypothesis.inner_test("triton", p),
    ),
    **{name: _gpu_target(problems) for name, problems in GPU_PROBLEMS.items()},
}


def run(name: str, seconds: float, chunk: int = 20) -> bool:
    """Rounds of ``chunk`` random examples of one target until ``seconds`` pass (each round draws new
    ones: not derandomized); False on a failure, which hypothesis shrinks and prints."""
    strategy, check = TARGETS[name]
    start, count = time.time(), [0, 0]  # drawn, checked (the rest fell outside the target: assume())
    skipped = []  # why a check skipped (a backend not installed here)

    @settings(
        derandomize=False,
        database=None,
        deadline=None,
        max_examples=chunk,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def rounds(x):
        count[0] += 1
        try:
            check(x)
        except pytest.skip.Exception as e:  # a backend not installed here: not a failure, not checked
            skipped[:] = [str(e)]
            reject()
        count[1] += 1

    while time.time() - start < seconds:
        try:
            rounds()
        except Unsatisfiable:
            if count[1] == 0 and skipped:  # every draw skipped: say why rather than fail
                print(f"{name}: nothing checked: {skipped[0]}", flush=True)
                return False
            continue  # a round whose every draw fell outside the target; the next draws anew
        except Exception as e:  # noqa: BLE001 - hypothesis re-raises the shrunk failure
            print(f"{name}: FAILED after {count[0]} examples\n{''.join(traceback.format_exception(e))[-4000:]}")
            return False
    elapsed = time.time() - start
    print(f"{name}: no failure in {count[1]} examples checked, {count[0]} drawn ({elapsed:.0f} s)", flush=True)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0, help="time budget of each target")
    p.add_argument("--targets", default="triton,tiles,features,kv,decode", help=f"of {','.join(TARGETS)}")
    p.add_argument("--chunk", type=int, default=20, help="examples a round (the budget is checked between rounds)")
    p.add_argument("--gpu-backends", default="", help=f"the gpu_* targets' backends (default all: {T.GPU_BACKENDS})")
    a = p.parse_args(argv)
    if a.gpu_backends:
        backends = tuple(a.gpu_backends.split(","))
        TARGETS.update({name: _gpu_target(problems, backends) for name, problems in GPU_PROBLEMS.items()})
    names = [n for n in a.targets.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"unknown targets {unknown}; allowed: {', '.join(TARGETS)}")
    return 0 if all([run(n, a.seconds, a.chunk) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main())
