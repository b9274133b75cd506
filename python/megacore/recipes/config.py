"""The recipe object: nested dataclasses describing one training run, validated as a whole before launch.

A recipe is plain data. Users edit its fields in Python (``recipe.parallel.tensor_model_parallel_size = 2``)
or from the command line (``--set parallel.tp=2``), ``validate()`` checks every constraint that would
otherwise surface mid-run (world size, batch divisibility, layer layout, data files, checkpoint model), and
``to_json``/``to_yaml``/``from_dict`` round-trip it so a run can be reproduced from the config it saved.

The sections and fields are not listed here: they are declared once, in C++ (``train::RunConfig`` in
``include/megacore/train/run_config.hpp``, the model's shape in ``TransformerConfig``), and these classes
are generated from that schema at import (names, types, defaults, docs, accepted values, ``--set``
aliases). Parsing, ``--set`` and validation run in C++ too, so Python and C++ accept exactly the same
recipes. ``describe()`` prints every field with its doc.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import field

from .. import _C
from ..errors import ConfigError

_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "list[int]": list, "list[str]": list,
          "list[float|str]": list}
_SCHEMA = json.loads(_C.train.run_config_schema())
_CLASS_NAMES = {"model": "ModelConfig", "parallel": "ParallelConfig", "data": "DataConfig", "optim": "OptimizerConfig",
                "trainer": "TrainerConfig", "checkpoint": "CheckpointConfig", "logging": "LoggingConfig",
                "resources": "Resources", "peft": "PeftConfig"}


def _run_config(recipe_or_dict) -> "_C.train.RunConfig":
    d = recipe_or_dict.to_dict() if isinstance(recipe_or_dict, Recipe) else recipe_or_dict
    return _C.train.RunConfig.from_json(json.dumps(d))


class _Section:
    """Methods shared by every generated section class."""

    @classmethod
    def field_docs(cls) -> dict:
        """{field: doc} of this section, as declared in C++."""
        return {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}


class _ModelMethods(_Section):
    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "ModelConfig":
        """A ModelConfig with the fields of a C++ preset (``tiny_llama``, ``llama32_1b``, ``llama3_8b``, ...)."""
        mc = cls(**json.loads(_C.train.model_preset_json(preset)))
        for k, v in overrides.items():
            setattr(mc, k, v)
        return mc

    def to_transformer_config(self, params_dtype: str = "f32", sequence_parallel: bool = False,
                              recompute: str = "none"):
        """The C++ ``megacore.model.TransformerConfig`` for this model with the given runtime settings."""
        r = Recipe(model=self)
        r.trainer.precision = params_dtype
        r.parallel.sequence_parallel = sequence_parallel
        r.trainer.recompute = recompute
        return _run_config(r).transformer_config(False)


class _ResourcesMethods(_Section):
    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


def _make_class(name: str, spec: list, base: type) -> type:
    fields = []
    for f in spec:
        md = {"doc": f["doc"], "choices": tuple(f["choices"]), "alias": f.get("alias", "")}
        default = f["default"]
        if isinstance(default, list):
            fd = field(default_factory=lambda d=default: list(d), metadata=md)
        else:
            fd = field(default=default, metadata=md)
        fields.append((f["name"], _TYPES[f["type"]], fd))
    cls = dataclasses.make_dataclass(name, fields, bases=(base,))
    cls.__module__ = __name__
    lines = [f"    {f['name']} ({f['type']}{', one of ' + ' | '.join(f['choices']) if f['choices'] else ''}): {f['doc']}"
             for f in spec]
    cls.__doc__ = f"Recipe section generated from the C++ RunConfig.\n\nFields:\n" + "\n".join(lines)
    return cls


_SECTIONS = {s["name"]: s for s in _SCHEMA if s["type"] == "section"}
_BASES = {"model": _ModelMethods, "resources": _ResourcesMethods}
_classes = {name: _make_class(_CLASS_NAMES[name], s["fields"], _BASES.get(name, _Section))
            for name, s in _SECTIONS.items()}
ModelConfig = _classes["model"]
ParallelConfig = _classes["parallel"]
DataConfig = _classes["data"]
OptimizerConfig = _classes["optim"]
TrainerConfig = _classes["trainer"]
CheckpointConfig = _classes["checkpoint"]
LoggingConfig = _classes["logging"]
Resources = _classes["resources"]
PeftConfig = _classes["peft"]

#: Short names accepted by set() / --set (``parallel.tp``), from the C++ field declarations.
ALIASES = {name: {f["alias"]: f["name"] for f in s["fields"] if f.get("alias")} for name, s in _SECTIONS.items()}


class _RecipeMethods:
    # ---- serialisation ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, path: str | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2)
        if path:
            _write_atomic(path, s + "\n")
        return s

    def to_yaml(self, path: str | None = None) -> str:
        yaml = _yaml()
        s = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path:
            _write_atomic(path, s)
        return s

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        """Parsed by the C++ RunConfig: unknown sections or fields, wrong types and names outside a field's
        accepted values are ConfigError naming the field and what it accepts; missing fields keep defaults."""
        if not isinstance(d, dict):
            raise ConfigError(f"recipe must be a mapping of sections, got {d!r}")
        full = json.loads(_run_config(d).to_json())
        return cls(name=full.pop("name"), **{k: _classes[k](**v) for k, v in full.items()})

    @classmethod
    def from_file(cls, path: str) -> "Recipe":
        """A recipe saved with to_json / to_yaml (by extension: .yaml/.yml, else JSON)."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read recipe file '{path}': {e.strerror}; pass the path of a saved "
                              "recipe (config.json / config.yaml)") from None
        is_yaml = path.endswith((".yaml", ".yml"))
        try:
            d = _yaml().safe_load(text) if is_yaml else json.loads(text)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any parse error becomes a ConfigError naming the file
            raise ConfigError(f"recipe file '{path}' is not valid {'YAML' if is_yaml else 'JSON'}: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"recipe file '{path}' must hold a mapping of sections, got {type(d).__name__}")
        return cls.from_dict(d)

    def copy(self) -> "Recipe":
        return Recipe.from_dict(self.to_dict())

    # ---- overrides -----------------------------------------------------------------------------------
    def set(self, key: str, value) -> "Recipe":
        """Sets a dotted field (``parallel.tp``, ``optim.lr``; aliases accepted); the value is converted to the
        field's type by the C++ parser. Unknown sections or fields, and values outside a field's accepted set,
        are ConfigError listing the valid ones."""
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            text = json.dumps(list(value))
        else:
            text = str(value)
        rc = _run_config(self)
        rc.set(key, text)
        full = json.loads(rc.to_json())
        if key == "name":
            # Directories a recipe derived from its name (runs/<name>/...) follow a new name.
            old, self.name = self.name, full["name"]
            if (self.checkpoint.save_dir, self.logging.log_dir) == (f"runs/{old}/checkpoints", f"runs/{old}/logs"):
                self.checkpoint.save_dir, self.logging.log_dir = f"runs/{self.name}/checkpoints", f"runs/{self.name}/logs"
            return self
        section = key.split(".", 1)[0]
        setattr(self, section, _classes[section](**full[section]))
        return self

    def apply_overrides(self, items) -> "Recipe":
        """``["parallel.tp=2", "optim.lr=1e-3"]`` (the CLI's --set values)."""
        for it in items or []:
            if "=" not in it:
                raise ConfigError(f"--set '{it}' must be key=value, e.g. parallel.tp=2")
            k, v = it.split("=", 1)
            self.set(k.strip(), v.strip())
        return self

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.resources.world_size

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        return self.world_size // mp if mp > 0 and self.world_size % mp == 0 else 0

    @property
    def num_microbatches(self) -> int:
        dp = self.data_parallel_size
        d = self.data
        return d.global_batch_size // (d.micro_batch_size * dp) if dp else 0

    def transformer_config(self, on_gpu: bool = False):
        """The C++ TransformerConfig the layers get (precision 'auto' resolved for `on_gpu`)."""
        return _run_config(self).transformer_config(on_gpu)

    def validate(self, check_paths: bool = True) -> list[str]:
        """The C++ validation of the run as a whole (train::validate): raises ConfigError listing every problem
        with its fix; returns warnings (strings)."""
        errors, warnings = _run_config(self).validate(self.world_size, check_paths)
        if errors:
            raise ConfigError("invalid recipe:\n  " + "\n  ".join(errors))
        return list(warnings)

    @staticmethod
    def describe() -> str:
        """Every section and field with its type, default, accepted values, alias and doc."""
        out = []
        for s in _SCHEMA:
            if s["type"] != "section":
                continue
            out.append(f"[{s['name']}] {s['doc']}")
            for f in s["fields"]:
                extra = f" one of {'|'.join(f['choices'])};" if f["choices"] else ""
                alias = f" (alias {s['name']}.{f['alias']})" if f.get("alias") else ""
                out.append(f"  {s['name']}.{f['name']}{alias}: {f['type']} = {json.dumps(f['default'])};{extra} "
                           f"{f['doc']}")
        return "\n".join(out)


Recipe = dataclasses.make_dataclass(
    "Recipe", [("name", str, field(default="custom"))] +
    [(n, c, field(default_factory=c)) for n, c in _classes.items()], bases=(_RecipeMethods,))
Recipe.__module__ = __name__
Recipe.__doc__ = "One training run: " + ", ".join(_SECTIONS) + " (see Recipe.describe())."


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ConfigError("YAML recipes need PyYAML (pip install pyyaml); or save and load them as JSON") from None
    return yaml


def _write_atomic(path: str, text: str):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
