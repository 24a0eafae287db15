"""Preset configs shipped with tamer: YAML files in `tamer/configs/` (`configs/` in the repository).

    tamer config list                            # names and what each is for
    tamer train --config configs/demo-calculator.yaml
    tamer train --config demo-calculator         # the same: a preset by name

`tamer demo --env NAME` runs the preset `demo-NAME`; `tamer compare` starts from `compare`.
Each file starts with a one-line `#` comment saying what it is for.
"""

from __future__ import annotations

from pathlib import Path

from tamer.config import ConfigError

PRESET_DIR = Path(__file__).parent / "configs"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The file of preset `name`; ConfigError listing the presets when there is none."""
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no preset {name!r}; presets: {', '.join(preset_names())}")
    return path


def describe_preset(name: str) -> str:
    """The preset's first-line comment."""
    first = preset_path(name).read_text().splitlines()[0] if preset_path(name).read_text() else ""
    return first.lstrip("#").strip()


def config_file(value: str | Path) -> Path:
    """`--config VALUE`: a YAML file, or else the name of a preset."""
    path = Path(value)
    if path.is_file() or path.suffix in (".yaml", ".yml") or "/" in str(value):
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        return path
    try:
        return preset_path(str(value))
    except ConfigError:
        raise ConfigError(f"config file {path} does not exist (nor a preset of that name; presets: "
                          f"{', '.join(preset_names())})") from None
