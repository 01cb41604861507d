"""``GroupedOptions``: what the grouped option dataclasses (``LayerConfig``, ``OptimConfig``) share.

Tasks and models take each concern as one dataclass instead of re-declaring its fields in every constructor
(as litgpt's ``Config``). The same object reads as a dataclass in Python, a mapping in YAML and checkpoint
hyper-parameters (``torch.load(weights_only=True)`` needs plain values), and nested options on the command line
(``--model.optim.lr_gates 0.2``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

__all__ = ["GroupedOptions"]

Options = TypeVar("Options", bound="GroupedOptions")


@dataclass(frozen=True)
class GroupedOptions:
    """Base of a dataclass of options that travels under one argument name (:attr:`argument`).

    A dataclass itself, with no fields: jsonargparse nests a dataclass's fields on the command line and in YAML
    only when every class it inherits from is a dataclass (else it asks for a ``class_path``).
    """

    argument: ClassVar[str]  # the constructor argument that takes the group, e.g. "layer_config"

    @classmethod
    def of(cls: type[Options], options: Options | Mapping[str, Any] | None) -> Options:
        """``options`` as the dataclass: an instance as it is, a mapping (YAML, checkpoint hyper-parameters)
        checked key by key, ``None`` the defaults."""
        if isinstance(options, cls):
            return options
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise TypeError(
                f"{cls.argument} must be a {cls.__name__} or a mapping of its fields, got {type(options).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown {cls.argument} option(s) {unknown}; {cls.__name__} takes {sorted(known)}")
        return cls(**options)

    @classmethod
    def refuse_flat_options(cls, kwargs: Mapping[str, Any]) -> None:
        """Fail with the fix when the group's options arrive as flat arguments (configs and checkpoints written
        before the options were grouped)."""
        flat = sorted(set(kwargs) & {f.name for f in fields(cls)})
        if flat:
            name = cls.argument
            raise ValueError(
                f"{flat} are {name} options: pass them inside {name} (YAML: '{name}: {{{flat[0]}: ...}}', "
                f"CLI: --model.{name}.{flat[0]}=..., Python: {name}={cls.__name__}({flat[0]}=...)); a "
                f"checkpoint saved with the flat options needs them moved under hyper_parameters['{name}']"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (what checkpoints and YAML hold)."""
        return asdict(self)
