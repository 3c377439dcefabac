"""The numerics guard's sampled check of a dense CUDA call replayed as one CUDA graph per
checked signature (issue 38: a check on ~1% of calls must cost well under 2% of them).

Per check, outside the graph: the picks' copy into the graph's static index buffer, one
indexing of each of the call's tensors into its static rows (guard_rows.dense_gathers), the
replay (guard_rows.dense_rows and measure(): ~25 kernels as one launch) and a copy of the
result.  A signature is everything the captured kernels depend on: the device and stream, the
rows' count, the shapes, strides and dtypes of every tensor and the options' values; no tensor
of a call is referenced inside a graph.  A graph's pool keeps its intermediates, so only
checks whose float64 keys and values fit GRAPH_ELEMENTS are captured, GRAPH_LIMIT signatures
at most (the first ones checked); the others, and a capture that fails, stay eager.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from ..caches import register_cache
from . import guard_rows as _rows

logger = logging.getLogger("attention_dispatch")

# float64 elements of the rows' keys and values a graph may hold (16 MiB: 8 rows of d128 at Sk 1024)
GRAPH_ELEMENTS = 1 << 21
GRAPH_LIMIT = 4


@dataclasses.dataclass
class _Graph:
    graph: object
    picks: torch.Tensor  # (7, n) int64, static
    inputs: dict  # name -> static gathered rows (guard_rows.gather: views of its packed buffers)
    result: torch.Tensor  # static payload
    positions: torch.Tensor  # read by the graph: kept alive here, whatever the positions cache drops
    fresh: bool = True  # the static buffers hold the capturing check's rows already


_graphs: dict = {}  # signature -> _Graph, or None: not captured (eager)
_streams: dict = {}  # device -> the side stream captures run on
_lock = threading.Lock()


def _clear() -> None:
    with _lock:
        for device in {key[0] for key, state in _graphs.items() if state is not None}:
            torch.cuda.synchronize(device)  # no replay still reading a pool dropped here
        _graphs.clear()


register_cache("guard.graphs", _clear, lambda: len(_graphs))


def _describe(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


def _signature(query, key, value, options: dict, out, lse, n: int) -> tuple:
    opts = tuple((k, _describe(v) if isinstance(v, torch.Tensor) else v) for k, v in sorted(options.items()))
    stream = torch.cuda.current_stream(query.device).cuda_stream
    return (query.device, stream, n, *(_describe(t) for t in (query, key, value, out, lse)), opts)


def capturable(query, key, value, options: dict, n: int, keep) -> bool:
    """A dense CUDA call without dropout whose rows fit GRAPH_ELEMENTS, outside any capture."""
    if query.device.type != "cuda" or options["cu_seqlens_q"] is not None or keep is not None:
        return False
    if n * key.shape[2] * (key.shape[3] + value.shape[3]) > GRAPH_ELEMENTS:
        return False
    return not torch.cuda.is_current_stream_capturing()


def payload(problem, query, key, value, options: dict, out, lse, columns) -> torch.Tensor | None:
    """guard.payload() for a capturable call (columns: guard_rows.dense_columns' host picks)
    through its signature's graph, captured on its first check; None where it stays eager."""
    try:
        signature = _signature(query, key, value, options, out, lse, len(columns[0]))
        hash(signature)
    except TypeError:  # an option's value that cannot key a graph
        return None
    host = torch.tensor(columns, dtype=torch.int64).pin_memory()
    with _lock:  # one check at a time fills a graph's static buffers
        state = _graphs.get(signature, False)
        if state is False:
            if len(_graphs) >= GRAPH_LIMIT:
                return None
            state = _graphs[signature] = _capture(problem, query, key, value, options, out, lse, host)
        if state is None:
            return None
        if not state.fresh:  # no grad: out= takes no tensor requiring one
            state.picks.copy_(host, non_blocking=True)
            found = _rows.dense_gathers(problem, state.picks, query, key, value, options, out, lse)
            with torch.no_grad():
                for name, (source, index) in found.items():
                    torch.ops.aten.index.Tensor_out(source, list(index), out=state.inputs[name])
        state.fresh = False
        state.graph.replay()
        return state.result.clone()  # the static result is the next replay's


def _capture(problem, query, key, value, options, out, lse, host) -> _Graph | None:
    """Gather the rows eagerly into new static buffers, warm the measurement up on a side
    stream (cuBLAS's workspace, the cached positions: made outside the capture), capture it;
    None (logged) where the capture fails."""
    device, sk = query.device, key.shape[2]
    scale, softcap, dtype, with_lse = options["scale"], options.get("softcap"), query.dtype, lse is not None
    with torch.inference_mode(False), torch.no_grad():
        picks = host.to(device, non_blocking=True)
        found = _rows.dense_gathers(problem, picks, query, key, value, options, out, lse)
        inputs = _rows.gather(found)

        def measure():
            rows = _rows.dense_rows(inputs, picks, options, sk)
            return torch.cat([_rows.measure([rows], scale, softcap, dtype, with_lse), picks[:3].flatten()])

        current = torch.cuda.current_stream(device)
        side = _streams.setdefault(device, torch.cuda.Stream(device))
        graph = torch.cuda.CUDAGraph()
        try:
            side.wait_stream(current)
            with torch.cuda.stream(side):
                measure()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    result = measure()
                finally:
                    graph.capture_end()
            current.wait_stream(side)
        except RuntimeError as exc:
            current.wait_stream(side)
            logger.warning("numerics guard: its check of %s stays eager: capture failed: %s", problem.summary(), exc)
            return None
        for t in (picks, *inputs.values()):
            t.record_stream(side)
    return _Graph(graph, picks, inputs, result, _rows.positions(sk, device))
