"""Keep torch's fused transformer kernel away from blocks whose feed-forward is a comera layer.

In eval mode ``nn.TransformerEncoderLayer`` runs one fused kernel, ``torch._transformer_encoder_layer_fwd``, that takes
``linear1.weight`` and ``linear2.weight`` as dense matrices, and ``nn.TransformerEncoder`` reads the same weights
before packing a padded batch into a nested tensor for it. A TT layer has no dense weight; building one on every
call would cost the ``M x N`` matrix and its merge each time, which is what the factored forward avoids. So
:func:`~comera_lightning.nn.tensorize` switches that path off, with the switches torch itself checks, for the blocks
whose ``linear1``/``linear2`` lost their ``.weight``:

* the layer's ``activation_relu_or_gelu`` becomes 0: torch only checks it to pick the fused kernel, and the layer's
  own forward keeps applying ``self.activation``;
* the encoder's ``use_nested_tensor`` becomes False (its nested packing only serves the fused kernel).

Attention stays dense (``tensorize`` never replaces ``out_proj``), so ``nn.MultiheadAttention`` keeps its own fast
path. The switches are plain attributes: they survive ``deepcopy``, pickling and ``state_dict`` round trips, and
:func:`~comera_lightning.nn.untensorize` puts back the values torch chose.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["restore_fast_paths", "steer_off_fast_paths"]

_SAVED = "_comera_fast_path"  # the value torch had chosen, kept on the module while the switch is off


def _lacks_dense_weights(layer: nn.TransformerEncoderLayer) -> bool:
    return not all(
        isinstance(getattr(getattr(layer, name, None), "weight", None), torch.Tensor) for name in ("linear1", "linear2")
    )


def steer_off_fast_paths(model: nn.Module) -> list[str]:
    """Switch off torch's fused encoder path wherever it would read a dense weight that is not there.

    Returns:
        The qualified names of the modules switched off (already switched-off ones included).
    """
    steered = []
    for name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer) and _lacks_dense_weights(module):
            if not hasattr(module, _SAVED):
                setattr(module, _SAVED, module.activation_relu_or_gelu)
            module.activation_relu_or_gelu = 0
            steered.append(name)
        elif isinstance(module, nn.TransformerEncoder) and any(
            isinstance(layer, nn.TransformerEncoderLayer) and _lacks_dense_weights(layer) for layer in module.layers
        ):
            if not hasattr(module, _SAVED):
                setattr(module, _SAVED, getattr(module, "use_nested_tensor", False))
            module.use_nested_tensor = False
            steered.append(name)
    return steered


def restore_fast_paths(model: nn.Module) -> None:
    """Undo :func:`steer_off_fast_paths` wherever the dense weights are back."""
    for module in model.modules():
        if not hasattr(module, _SAVED):
            continue
        if isinstance(module, nn.TransformerEncoderLayer) and not _lacks_dense_weights(module):
            module.activation_relu_or_gelu = getattr(module, _SAVED)
            delattr(module, _SAVED)
        elif isinstance(module, nn.TransformerEncoder) and not any(
            isinstance(layer, nn.TransformerEncoderLayer) and _lacks_dense_weights(layer) for layer in module.layers
        ):
            module.use_nested_tensor = getattr(module, _SAVED)
            delattr(module, _SAVED)
