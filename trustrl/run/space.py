"""Search spaces for ``trustrl tune``: which config fields a study samples, and from what.

A space names config fields with dots (``ppo.learning_rate``) and gives each a range
(``low``, ``high``, optionally ``log`` and ``step``; integer fields sample integers) or a
list of ``choices``. It comes from a TOML file::

    [ppo.learning_rate]
    low = 1e-5
    high = 1e-2
    log = true

    [rollout]
    num_steps = { choices = [256, 512, 1024] }
    gae_lambda = { low = 0.8, high = 1.0 }

or, without one, from the algorithm's default space (``default_space``). Every entry is
checked against the config before a trial runs: an unknown field, a range on a field that
takes choices, bounds of the wrong type, low above high, or a bound or choice the field
refuses is one ``SpaceError`` naming the entry. Sampling goes through an Optuna trial's
``suggest_*`` calls, so this module imports no Optuna.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Union, get_args, get_origin, get_type_hints

from trustrl.config import SECTIONS, Config, ConfigError, describe_value, read_toml

Kind = Literal["float", "int", "choice"]

# The sections a study may tune; ``runners`` and ``agent`` say where a run's data comes
# from, not how it learns.
TUNABLE = ("env", "rollout", "policy", "ppo", "trpo", "multiagent")
RANGE_KEYS = ("low", "high", "log", "step")
ENTRY_KEYS = (*RANGE_KEYS, "choices")


class SpaceError(ConfigError):
    """A search space that cannot be used; the message names the entry and why."""


class Suggester(Protocol):
    """What a space samples through: an Optuna trial (``optuna.Trial``)."""

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = ..., log: bool = ...
    ) -> float: ...
    def suggest_int(
        self, name: str, low: int, high: int, *, step: int = ..., log: bool = ...
    ) -> int: ...
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclass(frozen=True)
class Param:
    """One config field of a space and what it is sampled from."""

    name: str
    """The field, with its section: ``ppo.learning_rate``."""
    kind: Kind
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()
    """Config values; a list value (``policy.hidden_sizes``) is offered to Optuna as its
    JSON text, which Optuna's choices must be (None, bool, int, float or str)."""

    @property
    def section(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.name.split(".", 1)[1]

    def sample(self, trial: Suggester) -> Any:
        """The config value drawn for this field."""
        if self.kind == "float":
            return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)
        if self.kind == "int":
            step = int(self.step) if self.step is not None else 1
            return trial.suggest_int(
                self.name, int(self.low), int(self.high), step=step, log=self.log
            )
        return self.value(trial.suggest_categorical(self.name, self.optuna_choices))

    @property
    def optuna_choices(self) -> list[Any]:
        return [json.dumps(c) if isinstance(c, list | tuple) else c for c in self.choices]

    def value(self, sampled: Any) -> Any:
        """The config value of a value Optuna holds for this field (its JSON text, for a
        list)."""
        if self.kind == "choice" and isinstance(sampled, str) and sampled not in self.choices:
            return json.loads(sampled)
        return sampled

    def to_dict(self) -> dict[str, Any]:
        """The entry as a space file writes it (what a study stores of its space)."""
        if self.kind == "choice":
            return {"choices": [list(c) if isinstance(c, tuple) else c for c in self.choices]}
        entry: dict[str, Any] = {"low": self.low, "high": self.high}
        if self.log:
            entry["log"] = True
        if self.step is not None:
            entry["step"] = self.step
        return entry

    def describe(self) -> str:
        if self.kind == "choice":
            return f"one of {', '.join(map(str, self.to_dict()['choices']))}"
        scale = "log-uniform" if self.log else "uniform"
        kind = "integer" if self.kind == "int" else scale
        return f"{kind} in [{self.low:g}, {self.high:g}]" + (
            f" step {self.step:g}" if self.step is not None else ""
        )


@dataclass(frozen=True)
class SearchSpace:
    """The fields a study samples (in the order given)."""

    params: tuple[Param, ...]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def sample(self, trial: Suggester) -> dict[str, Any]:
        """One value per field, by dotted name, drawn through ``trial``."""
        return {p.name: p.sample(trial) for p in self.params}

    def values(self, sampled: dict[str, Any]) -> dict[str, Any]:
        """The config values of the values Optuna holds for a trial (``trial.params``)."""
        by_name = {p.name: p for p in self.params}
        return {
            name: by_name[name].value(value) if name in by_name else value
            for name, value in sampled.items()
        }

    def to_dict(self) -> dict[str, Any]:
        return {p.name: p.to_dict() for p in self.params}


def overrides(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted names and values as the config's nested tables:
    ``{"ppo.clip_coef": 0.1}`` -> ``{"ppo": {"clip_coef": 0.1}}``."""
    table: dict[str, Any] = {}
    for name, value in values.items():
        section, field = name.split(".", 1)
        table.setdefault(section, {})[field] = value
    return table


def _is(value: Any, *types_: type) -> bool:
    return isinstance(value, types_) and not isinstance(value, bool)


def _field_hint(name: str, algo: str) -> Any:
    """The annotated type of the config field ``name``, or a SpaceError saying why there
    is no such field to tune."""
    section, dot, field = name.partition(".")
    if not dot or "." in field:
        raise SpaceError(
            f"{name}: name a config field as <section>.<field> (e.g. ppo.learning_rate); "
            f"sections: {', '.join(TUNABLE)}"
        )
    if section not in TUNABLE:
        raise SpaceError(f"{name}: no tunable section {section!r}; sections: {', '.join(TUNABLE)}")
    if section in ("ppo", "trpo") and section != algo:
        raise SpaceError(f"{name}: a {algo} study does not use the [{section}] section")
    hints = get_type_hints(SECTIONS[section])
    if field not in hints:
        raise SpaceError(f"{name}: unknown field; [{section}] has {', '.join(sorted(hints))}")
    return hints[field]


def _numeric_kind(hint: Any) -> Kind | None:
    """``float`` or ``int`` for a numeric field (optional ones included), else None."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    options = tuple(o for o in options if o is not type(None))
    if options == (float,):
        return "float"
    if options == (int,):
        return "int"
    return None


def parse_entry(name: str, entry: Any, algo: str) -> Param:
    """One space file entry as a Param, its shape and types checked (not yet its values
    against the config: ``check_space``)."""
    hint = _field_hint(name, algo)
    if not isinstance(entry, dict):
        raise SpaceError(
            f"{name}: an entry is a table with low and high, or with choices; got "
            f"{describe_value(entry)}"
        )
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise SpaceError(
            f"{name}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; an "
            f"entry has low, high (and log, step) or choices"
        )
    if "choices" in entry:
        return _choices(name, entry)
    return _range(name, entry, hint)


def _choices(name: str, entry: dict[str, Any]) -> Param:
    extra = [k for k in RANGE_KEYS if k in entry]
    if extra:
        raise SpaceError(f"{name}: give choices or a range ({', '.join(extra)}), not both")
    choices = entry["choices"]
    if not isinstance(choices, list) or not choices:
        raise SpaceError(f"{name}: choices must be a non-empty list, got {describe_value(choices)}")
    values = tuple(tuple(c) if isinstance(c, list) else c for c in choices)
    if len(set(map(repr, values))) != len(values):
        raise SpaceError(f"{name}: choices {choices!r} repeat a value")
    return Param(name, "choice", choices=values)


def _range(name: str, entry: dict[str, Any], hint: Any) -> Param:
    kind = _numeric_kind(hint)
    if kind is None:
        raise SpaceError(
            f"{name}: a range needs a numeric field; give choices = [...] for this one"
        )
    missing = [k for k in ("low", "high") if k not in entry]
    if missing:
        raise SpaceError(f"{name}: a range needs low and high (missing {', '.join(missing)})")
    numeric = (int,) if kind == "int" else (int, float)
    words = "an integer" if kind == "int" else "a number"
    for key in ("low", "high", "step"):
        value: Any = entry.get(key)
        if key in entry and not (_is(value, *numeric) and math.isfinite(value)):
            raise SpaceError(f"{name}: {key} must be {words}, got {describe_value(value)}")
    low, high, step, log = entry["low"], entry["high"], entry.get("step"), entry.get("log", False)
    if not isinstance(log, bool):
        raise SpaceError(f"{name}: log must be true or false, got {describe_value(log)}")
    if low > high:
        raise SpaceError(f"{name}: low {low!r} is above high {high!r}")
    if log and low <= 0:
        raise SpaceError(f"{name}: a log scale needs low > 0, got {low!r}")
    if step is not None and (step <= 0 or log):
        why = "a log scale takes no step" if log else f"step must be > 0, got {step!r}"
        raise SpaceError(f"{name}: {why}")
    if kind == "float":
        low, high = float(low), float(high)
        step = float(step) if step is not None else None
    return Param(name, kind, low, high, log, step)


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Entries by dotted name: a table holding any entry key is an entry; other tables
    are sections (``[ppo.learning_rate]`` and ``"ppo.learning_rate" = {...}`` alike)."""
    found: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not set(value) & set(ENTRY_KEYS):
            found.update(_flatten(value, f"{name}."))
        else:
            found[name] = value
    return found


def space_from_dict(table: dict[str, Any], algo: str) -> SearchSpace:
    entries = _flatten(table)
    if not entries:
        raise SpaceError("the space names no field; give at least one entry")
    return SearchSpace(tuple(parse_entry(name, entry, algo) for name, entry in entries.items()))


def read_space(path: str, algo: str) -> SearchSpace:
    """A space file, parsed and its entries' shapes checked; errors name the file."""
    try:
        return space_from_dict(read_toml(path), algo)
    except SpaceError as exc:
        raise SpaceError(f"space file {path}: {exc}") from None


def check_space(space: SearchSpace, base: Config) -> None:
    """Each range's ends and each choice, set alone on ``base``, must be a value its
    config section accepts (checks across sections, such as minibatches against the
    batch, are left to each trial)."""
    for param in space.params:
        section = getattr(base, param.section)
        if param.kind == "choice":
            candidates = [("choice", value) for value in param.choices]
        else:
            candidates = [("low", param.low), ("high", param.high)]
        for what, value in candidates:
            try:
                dataclasses.replace(section, **{param.field: value})
            except ConfigError as exc:
                raise SpaceError(f"{param.name}: {what} {value!r} is refused: {exc}") from None
            except TypeError as exc:  # a value that breaks a comparison
                raise SpaceError(f"{param.name}: {what} {value!r} is refused: {exc}") from None


GAMMAS = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999)
LAMBDAS = (0.8, 0.9, 0.92, 0.95, 0.98, 0.99, 1.0)
MINIBATCHES = (1, 2, 4, 8, 16, 32, 64)


def default_space(base: Config, box_actions: bool) -> SearchSpace:
    """The algorithm's default space around ``base`` (the env's preset): rl-baselines3-zoo's
    PPO and TRPO samplers' ranges, with the rollout length as powers of two around the
    preset's, the minibatch counts that fit the smallest batch, and the initial log-std
    of Gaussian policies where actions are a Box."""
    steps = base.rollout.num_steps
    num_steps = sorted({max(1, steps * 2**k // 4) for k in range(5)})
    smallest_batch = base.num_envs * num_steps[0]
    minibatches = tuple(m for m in MINIBATCHES if m <= smallest_batch)
    common = [
        Param("rollout.num_steps", "choice", choices=tuple(num_steps)),
        Param("rollout.gamma", "choice", choices=GAMMAS),
        Param("rollout.gae_lambda", "choice", choices=LAMBDAS),
    ]
    if base.algo == "trpo":
        params = [
            Param("trpo.max_kl", "float", 1e-3, 0.1, log=True),
            Param("trpo.vf_lr", "float", 1e-4, 1e-2, log=True),
            *common,
            Param("trpo.cg_damping", "float", 0.01, 0.5, log=True),
            Param("trpo.cg_iters", "choice", choices=(5, 10, 20, 25, 30)),
            Param("trpo.train_vf_iters", "choice", choices=(5, 10, 20, 25, 30)),
            Param("trpo.minibatches", "choice", choices=minibatches),
        ]
    else:
        if base.ppo.separate_optimizers:
            rates = [
                Param("ppo.pi_lr", "float", 1e-5, 1e-2, log=True),
                Param("ppo.vf_lr", "float", 1e-5, 1e-2, log=True),
            ]
        else:
            rates = [
                Param("ppo.learning_rate", "float", 1e-5, 1e-2, log=True),
                Param("ppo.vf_coef", "float", 0.1, 1.0),
            ]
        params = [
            *rates,
            *common,
            Param("ppo.num_minibatches", "choice", choices=minibatches),
            Param("ppo.update_epochs", "int", 2, 20),
            Param("ppo.clip_coef", "choice", choices=(0.1, 0.2, 0.3, 0.4)),
            Param("ppo.ent_coef", "float", 1e-8, 0.1, log=True),
            Param("ppo.max_grad_norm", "choice", choices=(0.3, 0.5, 0.7, 1.0, 2.0, 5.0)),
        ]
    if box_actions:
        params.append(Param("policy.log_std_init", "float", -4.0, 1.0))
    return SearchSpace(tuple(params))
