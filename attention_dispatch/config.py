"""Configuration: loading from TOML/YAML/env, validation, scoped overrides.

pydantic is used only for configuration (the models in config_models.py), imported when a
configuration is first loaded or validated; the per-call path reads the already validated,
frozen `Config` through `current_config()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError

    from .config_models import Config

ENV_CONFIG = "ATTENTION_DISPATCH_CONFIG"
ENV_BACKENDS = "ATTENTION_DISPATCH_BACKENDS"


class ConfigError(ValueError):
    """A configuration file or value is wrong; the message names the file and field."""


_MODELS = ("Config", "DispatchSection", "GuardSection")


def __getattr__(name: str):
    """config.Config and the sections, from config_models on first use (PEP 562)."""
    if name in _MODELS:
        from . import config_models

        return getattr(config_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _validation_lines(err: ValidationError, prefix: str = "") -> list[str]:
    """One line per pydantic error: '  field: what is wrong (got value)'."""
    lines = []
    for e in err.errors():
        field = prefix + ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not allowed)"
        lines.append(f"  {field}: {msg} (got {e.get('input')!r})")
    return lines


def _read_file(path: Path) -> dict:
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read configuration file: {exc.strerror or exc}") from None
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{path}: unknown configuration format {suffix!r}; allowed: .toml, .yaml, .yml")
    except ConfigError:
        raise
    except Exception as exc:  # a parser's own error: say which file
        raise ConfigError(f"{path}: cannot parse: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping, got {type(data).__name__}")
    return data


def validate_config(data: dict, origin: str = "<config>") -> Config:
    """Validate a mapping into a Config, checking backend names and per-backend options.
    Every problem found is reported, in one ConfigError."""
    from pydantic import ValidationError

    from . import registry
    from .config_models import Config
    from .policy import known_bad

    problems: list[str] = []
    config = None
    try:
        config = Config.model_validate(data)
    except ValidationError as err:
        problems.extend(_validation_lines(err))
    # the checks below read the raw mapping, so they run even where a field above failed
    known = registry.list_backends()
    dispatch = data.get("dispatch") if isinstance(data.get("dispatch"), dict) else {}
    for field in ("priority", "disabled"):
        names = dispatch.get(field)
        names = names if isinstance(names, (list, tuple)) else ()
        for name in names:
            if isinstance(name, str) and name not in known:
                problems.append(f"  dispatch.{field}: unknown backend {name!r}; registered: {', '.join(known)}")
    priority = dispatch.get("priority")
    if isinstance(priority, (list, tuple)) and len(set(map(str, priority))) != len(priority):
        problems.append(f"  dispatch.priority: a backend is listed twice: {list(priority)}")
    entries = data.get("known_bad", ())
    if isinstance(entries, (list, tuple)) and all(isinstance(entry, dict) for entry in entries):
        try:
            known_bad.parse(entries, origin)
        except known_bad.KnownBadError as err:
            problems.append("  " + str(err).removeprefix(f"{origin}: "))
    backends = data.get("backends")
    for name, options in (backends if isinstance(backends, dict) else {}).items():
        if name not in known:
            problems.append(f"  backends.{name}: unknown backend; registered: {', '.join(known)}")
            continue
        if not isinstance(options, dict):
            continue  # pydantic said so above
        model = registry.get_backend(name).options_model
        if model is None:
            if options:
                problems.append(f"  backends.{name}: this backend takes no options (got {sorted(options)})")
            continue
        try:
            model.model_validate(options)
        except ValidationError as err:
            problems.extend(_validation_lines(err, f"backends.{name}."))
    if problems:
        raise ConfigError("\n".join([f"{origin}: invalid configuration", *problems]))
    return config


def read_config(path: str | os.PathLike) -> Config:
    """Read and validate one TOML or YAML file, without making it current."""
    path = Path(path)
    return validate_config(_read_file(path), str(path)).model_copy(update={"source": f"config {path}"})


# ---- current configuration: process-wide loaded one, plus a contextvars scope -------------

_lock = threading.Lock()
_loaded: Config | None = None
_version = 0
_scoped: contextvars.ContextVar[Config | None] = contextvars.ContextVar("attention_dispatch_config", default=None)


def _bump() -> None:
    global _version
    _version += 1


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Make a config file current for the process (None: env ATTENTION_DISPATCH_CONFIG or defaults)."""
    global _loaded
    if path is None:
        path = os.environ.get(ENV_CONFIG) or None
    if path:
        config = read_config(path)
    else:
        from .config_models import Config

        config = Config()
    with _lock:
        _loaded = config
        _bump()
    return config


def reset_config() -> None:
    """Forget the loaded config; the next call reads the environment again."""
    global _loaded
    with _lock:
        _loaded = None
        _bump()


def current_config() -> Config:
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    if _loaded is None:
        load_config()
    return _loaded


def config_version() -> int:
    return _version


# Cache keys (decisions, sdpa()'s fast path) name the current config by id().  A config that
# has been scoped stays referenced here, so its id is never given to another object while a
# key may hold it; entering and leaving a scope then invalidates nothing, and a step loop
# under `with use_config(...)` keeps its cached decisions and fast path.
PIN_LIMIT = 256
pinned: dict[int, Config] = {}
_from_dicts: dict[str, Config] = {}  # equal dicts -> one (frozen) Config, so one id


def _pin(config: Config) -> None:
    if pinned.get(id(config)) is not config:
        with _lock:
            if len(pinned) >= PIN_LIMIT:  # dropping pins frees ids: no key naming them may hit
                pinned.clear()
                _bump()
            pinned[id(config)] = config


def _config_of_dict(data: dict) -> Config:
    try:
        key = json.dumps(data, sort_keys=True)
    except (TypeError, ValueError):  # not plain data: validated afresh each time
        return validate_config(data, "<use_config>")
    config = _from_dicts.get(key)
    if config is None:
        config = validate_config(data, "<use_config>")
        with _lock:
            if len(_from_dicts) >= PIN_LIMIT:
                _from_dicts.clear()
            _from_dicts[key] = config
    return config


@contextlib.contextmanager
def use_config(config: Config | dict | str | os.PathLike):
    """Scoped configuration for this context (thread / task); restored on exit."""
    from .config_models import Config

    if isinstance(config, dict):
        config = _config_of_dict(config)
    elif not isinstance(config, Config):
        config = read_config(config)
    _pin(config)
    token = _scoped.set(config)
    try:
        yield config
    finally:
        _scoped.reset(token)


def env_priority() -> tuple[str, ...] | None:
    """The order from env ATTENTION_DISPATCH_BACKENDS (comma separated), if set."""
    raw = os.environ.get(ENV_BACKENDS, "").strip()
    if not raw:
        return None
    return tuple(n.strip() for n in raw.split(",") if n.strip())
