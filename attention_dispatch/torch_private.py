"""torch's private APIs, each behind one adapter that is on only for torch releases it was run on.

:data:`tensor_check` is dynamo's C++ ``TensorGuards`` (``torch._C._dynamo.guards``), which
fast_key's recent signatures use to check a call's tensors (issue 35).  Any other torch, or
one without it, gets None and the caller builds its key from Python as before.
:data:`deterministic` and :data:`deterministic_warn_only` are the C getters behind
``torch.are_deterministic_algorithms_enabled()`` and its warn-only twin (fast_key reads them per
call), else those public functions.  :data:`compiler` holds ``_is_compiling_flag``, which
``torch.compiler.is_compiling()`` returns (after a TorchScript check), for sdpa()'s hit path
(a read, not two Python calls: experiment 91), else a stand-in calling the public function.
:data:`cuda_device` and :data:`cuda_raw_stream` give the current device's raw stream without
``torch.cuda``'s lazy-init check (kernels.compiled_cache), else None.  :data:`any_autocast` is
``torch._C._is_any_autocast_enabled`` (sdpa() asks it per call: one C call where asking each device
type's public ``torch.is_autocast_enabled`` costs ~0.5 us), else a stand-in answering True, so the
caller asks the public function.  :data:`forward_ad` holds ``_current_level``, the module global of
``torch.autograd.forward_ad`` (-1 outside every ``dual_level``; sdpa() reads it per call), else a
stand-in answering 0, so callers check each tensor with the public ``unpack_dual``.
:data:`checkpoint_stop` is ``torch.utils.checkpoint._StopRecomputationError``, which non-reentrant activation
checkpointing raises through the recomputed forward to end it early: sdpa()'s handlers of a backend's failure let
it through (on any torch that has it: it is only let pass, never raised or relied upon), else a class nothing
raises.  :func:`functorch_wrapped` is ``torch._C._functorch.is_functorch_wrapped_tensor`` (a tensor that torch.func's
vmap, grad or jvp wraps), else a stand-in telling a tensor without storage.  Imports nothing of this
package, so kernels may import it.
tests/test_torch_private.py checks each against its public twin and the attribute's presence.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.utils.checkpoint

try:  # private to dynamo
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:
    _TensorGuards = None

# (major, minor) range the adapters were run on: 2.11 (the H100 machine) to 2.13 (CI).
TESTED_TORCH = ((2, 11), (2, 13))


def untested_torch(version: str) -> str | None:
    """Why a torch release keeps the private adapters off, or None for a tested one."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = TESTED_TORCH
    if match and low <= (int(match[1]), int(match[2])) <= high:
        return None
    tested = f"{low[0]}.{low[1]}-{high[0]}.{high[1]}"
    return f"torch {version or '(unknown version)'} is not a tested release ({tested}) for its private APIs"


def _tensor_check(*tensors: torch.Tensor) -> Callable[..., bool] | None:
    """``check(*others)``, True when ``others`` match ``tensors`` one for one in Python type,
    dispatch keys (conj/neg views), dtype, device, requires_grad, sizes and strides (and the
    thread's dispatch state); None where TensorGuards refuses these tensors."""
    try:  # static sizes and strides: dynamo's dynamic dims off
        check = _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        return check if check(*tensors) else None
    except Exception:  # noqa: BLE001 - a TensorGuards that refuses these tensors: no check
        return None


def _adapter(version: str):
    """:func:`_tensor_check` on a tested torch that has TensorGuards, else None."""
    return _tensor_check if _TensorGuards is not None and untested_torch(version) is None else None


tensor_check = _adapter(torch.__version__)


class _Compiling:
    """The stand-in for ``torch.compiler`` where its flag is not used: the public function."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


def _compiler(version: str):
    """``torch.compiler`` on a tested torch that has the flag torch.compiler.is_compiling()
    returns outside TorchScript, else :class:`_Compiling`."""
    tested = untested_torch(version) is None and hasattr(torch.compiler, "_is_compiling_flag")
    return torch.compiler if tested else _Compiling()


compiler = _compiler(torch.__version__)


def _private(name: str, public, version: str):
    """``torch._C.<name>`` on a tested torch that has it, else ``public``."""
    found = getattr(torch._C, name, None)
    return found if found is not None and untested_torch(version) is None else public


deterministic = _private("_get_deterministic_algorithms", torch.are_deterministic_algorithms_enabled, torch.__version__)
deterministic_warn_only = _private(
    "_get_deterministic_algorithms_warn_only", torch.is_deterministic_algorithms_warn_only_enabled, torch.__version__
)
# only as a pair: the raw stream is asked of the current device (None without CUDA built in)
cuda_device = _private("_cuda_getDevice", None, torch.__version__)
cuda_raw_stream = _private("_cuda_getCurrentRawStream", None, torch.__version__) if cuda_device else None
cuda_device = cuda_device if cuda_raw_stream else None


def _maybe_autocast() -> bool:
    """The stand-in for ``_is_any_autocast_enabled``: True, the caller then asks per device type."""
    return True


any_autocast = _private("_is_any_autocast_enabled", _maybe_autocast, torch.__version__)


class _ForwardLevel:
    """The stand-in for ``torch.autograd.forward_ad`` where its level is not read: a level may be open."""

    _current_level = 0


def _forward_ad(version: str):
    """``torch.autograd.forward_ad`` on a tested torch whose module has ``_current_level``, else
    :class:`_ForwardLevel`."""
    module = torch.autograd.forward_ad
    if untested_torch(version) is None and isinstance(getattr(module, "_current_level", None), int):
        return module
    return _ForwardLevel()


forward_ad = _forward_ad(torch.__version__)


def _storage_less(tensor: torch.Tensor) -> bool:
    """The stand-in for ``is_functorch_wrapped_tensor``: a tensor whose data pointer cannot be read."""
    try:
        tensor.data_ptr()
    except RuntimeError:
        return True
    return False


def _functorch_wrapped(version: str):
    """``torch._C._functorch.is_functorch_wrapped_tensor`` on a tested torch that has it, else
    :func:`_storage_less`."""
    found = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return found if found is not None and untested_torch(version) is None else _storage_less


functorch_wrapped = _functorch_wrapped(torch.__version__)


class _NeverRaised(Exception):
    """The stand-in for a control-flow exception this torch does not have: nothing raises it."""


def _checkpoint_stop():
    """``torch.utils.checkpoint._StopRecomputationError`` where it is an Exception class, else :class:`_NeverRaised`."""
    found = getattr(torch.utils.checkpoint, "_StopRecomputationError", None)
    return found if isinstance(found, type) and issubclass(found, Exception) else _NeverRaised


checkpoint_stop = _checkpoint_stop()
