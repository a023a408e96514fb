"""The registered implementation of each layer's parts (core/layer.py): the names a
ModelSpec gives looked up in the layer registries, and the check that the composed
model has every slot the spec lays out (``core.slots.slot_layout``)."""
from __future__ import annotations

from ..errors import UnsupportedModelError
from ..slots import slot_layout
from ..spec import ModelSpec


def _lookup(spec: ModelSpec, registries, kind: str, name: str, where: str):
    registry = registries[kind]
    if name not in registry:
        raise UnsupportedModelError(
            f"{spec.architecture}: {where} names the {kind} implementation {name!r}, which "
            f"no loaded plugin registers; registered {kind} implementations: "
            f"{', '.join(registry.names()) or '(none)'} (a family's own layers come with "
            "its plugin: is it installed and loaded? `infergraft plugins` lists them)")
    return registry.get(name)


def layer_parts(spec: ModelSpec, registries) -> tuple[list[tuple], object]:
    """([(attention, mlp, norm) LayerImpl for each layer], the final norm's LayerImpl).
    ``registries``: kind -> Registry (``PluginManager.layers()``)."""
    norm = _lookup(spec, registries, "norm", spec.norm, "ModelSpec.norm")
    parts = []
    for i in range(spec.num_layers):
        layer = spec.layer(i)
        parts.append((_lookup(spec, registries, "attention", layer.attention, f"layer {i}"),
                      _lookup(spec, registries, "mlp", layer.mlp, f"layer {i}"), norm))
    return parts, norm


def check_slots_built(model, spec: ModelSpec) -> None:
    """UnsupportedModelError naming each slot of the spec's layout that no module of
    ``model`` holds (a LayerSpec declaring a weight its parts do not build), and each
    ``weight`` a module holds that the layout lacks (one its parts build undeclared,
    which no weight map could fill)."""
    built = {f"{path}.{name}" if path else name
             for path, module in model.named_modules() for name in module._buffers}
    layout = slot_layout(spec)
    missing = [slot for slot in layout if slot not in built]
    stray = [slot for slot in built if slot.endswith(".weight") and slot not in layout]
    for slots, what in ((missing, "lays out slot(s) {} that the model composed from its "
                         "layer implementations does not build"),
                        (stray, "lacks slot(s) {} that its layer implementations build")):
        if slots:
            raise UnsupportedModelError(
                f"{spec.architecture}: the spec {what.format(slots[:5])}{_parts(spec, slots[0])}; "
                "a LayerSpec's slots must be the weights its parts add to the layer")


def _parts(spec: ModelSpec, slot: str) -> str:
    if not slot.startswith("layers."):
        return ""
    i = int(slot.split(".")[1])
    return f" (layer {i}: attention {spec.layer(i).attention!r}, mlp {spec.layer(i).mlp!r})"
