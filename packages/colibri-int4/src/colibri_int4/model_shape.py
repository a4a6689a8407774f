"""`ModelShape`, the config fields that decide tensor shapes (bounded against hostile headers), and
the one tensor table are colibri-spec's (`colibri_spec.tensor_table`); re-exported here. layout.py
places those tensors in a container.
"""

from colibri_spec import ModelShape, checkpoint_tensor_shapes, expert_tensor_names

__all__ = ["ModelShape", "checkpoint_tensor_shapes", "expert_tensor_names"]
