"""Hydra's compose API behind the CLI: presets and ``key=value`` overrides into a typed Config.

Compose never creates an output directory, writes ``.hydra/`` or changes the working directory;
the runner makes the run directory and writes the resolved config itself.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from rlorch.config.schema import Config, ConfigError

SCHEMA_NAME = "rlorch_schema"
DEFAULT_PRESET = "config"
_registered = False


def conf_dir() -> Path:
    """The directory holding the shipped presets (``RLORCH_CONF_DIR`` overrides it): ``conf/``
    beside the package in a source checkout, ``rlorch/conf/`` inside an installed wheel."""
    override = os.environ.get("RLORCH_CONF_DIR")
    if override:
        return Path(override)
    package = Path(__file__).resolve().parent.parent
    packaged = package / "conf"
    return packaged if packaged.is_dir() else package.parent / "conf"


RECIPES = "recipes"
"""``conf/recipes/``: whole runs for real models (``conf=recipes/NAME``), read as a YAML file of
your own is (its defaults list names the groups), not a config group."""


def presets() -> list[str]:
    """Names of the shipped top-level presets."""
    return sorted(p.stem for p in conf_dir().glob("*.yaml"))


def config_groups() -> list[str]:
    """Config groups (``inference``, ``trainer``, ``task``): subdirectories of the presets."""
    return sorted(p.name for p in conf_dir().iterdir()
                  if p.is_dir() and not p.name.startswith("_") and p.name != RECIPES)


def _register_schema() -> None:
    global _registered
    if not _registered:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
        _registered = True


def split_preset(overrides: list[str]) -> tuple[str, list[str]]:
    """Take ``conf=NAME`` (or ``conf=path.yaml``) out of the override list."""
    preset, rest = DEFAULT_PRESET, []
    for item in overrides:
        if item.startswith("conf="):
            preset = item.split("=", 1)[1]
        else:
            rest.append(item)
    return preset, rest


def _user_yaml_dir(path: Path) -> tuple[str, str]:
    """Lay a user YAML beside copies of the shipped presets so its defaults resolve.

    A file without a ``defaults`` list extends the default preset.
    """
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ConfigError("conf", f"file not found: {path}")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's errors carry line and column
        raise ConfigError("conf", f"{path} is not valid YAML: {err}") from err
    if not OmegaConf.is_dict(loaded):
        raise ConfigError("conf", f"{path} must hold a mapping of config sections")
    from rlorch.config.keys import check_preset

    check_preset(OmegaConf.to_container(loaded), str(path))
    _check_types(loaded, path)
    workdir = Path(tempfile.mkdtemp(prefix="rlorch-conf-"))
    shutil.copytree(conf_dir(), workdir, dirs_exist_ok=True)
    if "defaults" not in loaded:
        loaded = OmegaConf.merge({"defaults": [DEFAULT_PRESET, "_self_"]}, loaded)
    OmegaConf.save(loaded, workdir / "_user_preset.yaml")
    return str(workdir), "_user_preset"


def _check_types(loaded, path: Path) -> None:
    """Each value of a user preset fits its field's type. Hydra reports a wrong type in a
    preset as raised "in '_user_preset'", naming neither the key nor the file: checked here
    first, the error names both, and the value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    sections = {k: v for k, v in OmegaConf.to_container(loaded).items() if k not in ("defaults", "hydra")}
    try:
        OmegaConf.merge(OmegaConf.structured(Config), sections)
    except ValidationError as err:
        key = getattr(err, "full_key", None) or "conf"
        message = str(getattr(err, "msg", None) or err).splitlines()[0]
        raise ConfigError(key, f"in {path}: {message}") from err


def _explain(err: Exception, preset: str, overrides: list[str]) -> ConfigError:
    """Turn Hydra/OmegaConf composition errors into a ConfigError naming the key."""
    from hydra.errors import MissingConfigException

    text = str(err)
    cause = err.__cause__ or err
    key = getattr(cause, "full_key", None) or ""
    if isinstance(err, MissingConfigException):
        missing = getattr(err, "missing_cfg_file", "") or ""
        if "/" in missing:
            group, choice = missing.rsplit("/", 1)
            options = ", ".join(getattr(err, "options", None) or [])
            return ConfigError(group, f"no option {choice!r} (available: {options})")
        return ConfigError("conf", f"no preset {preset!r} (shipped: {', '.join(presets())}; "
                                   "or a path to a .yaml file)")
    match = re.search(r"Key '([^']+)' is not in struct", text)
    if match:
        from rlorch.config.keys import suggest

        full = re.search(r"full_key: (\S+)", text)
        name = full.group(1) if full else match.group(1)
        if name.startswith("task.params."):
            return _unknown_param(name, overrides)
        return ConfigError(name, f"unknown key{suggest(name)}")
    match = re.search(r"Could not override '([^']+)'", text)
    if match and not key:
        key = match.group(1)
    if key.startswith("task.params.") and "not in struct" in str(cause):
        return _unknown_param(key, overrides)
    first = str(cause).splitlines()[0] if str(cause) else text.splitlines()[0]
    return ConfigError(key or "overrides", first)


def _unknown_param(key: str, overrides: list[str]) -> ConfigError:
    """A ``task.params`` key the chosen task's preset lacks: composed again with it added (``+``)
    to learn which task it is, then named with that task's own parameters."""
    from rlorch.tasks.registry import unknown_param

    added = [f"+{item.lstrip('+')}" if item.split("=", 1)[0].lstrip("+") == key else item for item in overrides]
    try:
        task = compose(added).task.name
    except ConfigError:
        return ConfigError(key, "not a parameter of this task's preset; a new parameter takes a +: "
                                f"+{key}=VALUE")
    return unknown_param(task, key)


def compose(overrides: list[str] | None = None) -> Config:
    """Compose a preset plus overrides into a validated Config."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    _register_schema()
    preset, rest = split_preset(list(overrides or []))
    config_dir, config_name = str(conf_dir()), preset
    recipe = conf_dir() / f"{preset}.yaml"
    if preset.startswith(f"{RECIPES}/") and recipe.is_file():
        config_dir, config_name = _user_yaml_dir(recipe)
    elif preset.endswith((".yaml", ".yml")) or os.sep in preset:
        config_dir, config_name = _user_yaml_dir(Path(preset).expanduser().resolve())
    elif not (conf_dir() / f"{preset}.yaml").is_file():
        raise ConfigError("conf", f"no preset {preset!r} (shipped: {', '.join(presets())}; "
                                  "or a path to a .yaml file)")
    for item in rest:
        if "=" not in item:
            raise ConfigError(item, "overrides are key=value (e.g. rollout.max_staleness=2)")
    from rlorch.config.keys import check_overrides

    check_overrides(rest, groups=config_groups())
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name="rlorch"):
            raw = hydra_compose(config_name=config_name, overrides=rest)
    except ConfigError:
        raise
    except Exception as err:
        raise _explain(err, preset, list(overrides or [])) from err
    finally:
        if config_dir != str(conf_dir()):
            shutil.rmtree(config_dir, ignore_errors=True)
    try:
        return OmegaConf.to_object(raw)
    except ConfigError:
        raise
    except Exception as err:
        cause = err.__cause__ if isinstance(err.__cause__, ConfigError) else None
        if cause:
            raise cause from err
        raise _explain(err, preset, list(overrides or [])) from err


def expand_sweeps(overrides: list[str]) -> Iterator[tuple[dict[str, str], list[str]]]:
    """Expand comma-list sweeps (``a=1,2 b=x,y``) into one override list per combination.

    Yields ``(swept values by key, overrides)``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed, swept = [], []
    for raw, parsed in zip(overrides, parser.parse_overrides(overrides)):
        if parsed.is_sweep_override():
            swept.append((parsed.get_key_element(), list(parsed.sweep_string_iterator())))
        else:
            fixed.append(raw)
    keys = [k for k, _ in swept]
    for combo in itertools.product(*(values for _, values in swept)):
        chosen = dict(zip(keys, combo))
        yield chosen, fixed + [f"{k}={v}" for k, v in chosen.items()]
