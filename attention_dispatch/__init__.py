"""attention_dispatch: one sdpa() for every attention kernel, exact and explained."""

from .api import explain, sdpa
from .backends.base import Backend, Capabilities, not_supported_reasons
from .caches import clear_cache
from .config import ConfigError, load_config, read_config, reset_config, use_config
from .debug import configure_logging_from_env, last_decision, record
from .kvcache import explain_with_kvcache, sdpa_with_kvcache
from .patch import patch_sdpa, unpatch_sdpa
from .dispatch import BackendRunError, Decision, NoBackendError, use_backends
from .policy.guard import GuardError, guard_flush
from .problem import Problem
from .route import Route, RouteStep
from .registry import get_backend, list_backends, register_backend, unregister_backend
from .semantics import CausalKind

configure_logging_from_env()


def __getattr__(name: str):
    """ad.Config from config_models on first use: pydantic is for configuration only."""
    if name == "Config":
        from .config_models import Config

        return Config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "sdpa",
    "explain",
    "sdpa_with_kvcache",
    "explain_with_kvcache",
    "patch_sdpa",
    "unpatch_sdpa",
    "Backend",
    "Capabilities",
    "not_supported_reasons",
    "Config",
    "ConfigError",
    "load_config",
    "read_config",
    "reset_config",
    "use_config",
    "last_decision",
    "record",
    "Decision",
    "NoBackendError",
    "BackendRunError",
    "GuardError",
    "guard_flush",
    "clear_cache",
    "use_backends",
    "Problem",
    "Route",
    "RouteStep",
    "get_backend",
    "list_backends",
    "register_backend",
    "unregister_backend",
    "CausalKind",
    "__version__",
]
