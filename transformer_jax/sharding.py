"""Device mesh, logical-axis rules and sharded initialisation.

The model names logical axes on its parameters ('embed', 'heads', 'mlp', ...) and activations
('activation_batch', ...). The config maps logical names to mesh axes (rules as data, as in
Flax's lm1b and MaxText); this module turns that into `NamedSharding`s.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data',)


def create_mesh(mesh_shape: Sequence[int] = (-1,), axis_names: Sequence[str] = MESH_AXES,
                devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all); one -1 in mesh_shape takes the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  shape = list(mesh_shape)
  if len(shape) != len(axis_names):
    raise ValueError(f'mesh_shape {tuple(mesh_shape)} does not match axes {tuple(axis_names)}')
  if shape.count(-1) > 1:
    raise ValueError(f'mesh_shape {tuple(mesh_shape)} has more than one -1')
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f'mesh_shape {tuple(mesh_shape)} does not divide {len(devices)} devices')
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(f'mesh_shape {tuple(shape)} needs {int(np.prod(shape))} devices, '
                     f'have {len(devices)}')
  return Mesh(np.asarray(devices).reshape(shape), tuple(axis_names))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over every mesh axis that carries data."""
  return NamedSharding(mesh, PartitionSpec('data'))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
  """NamedShardings for a tree of (possibly `nn.Partitioned`-boxed) abstract values.

  Leaves without logical names are replicated.
  """
  specs = nn.get_partition_spec(abstract_tree)
  return nn.logical_to_mesh_sharding(specs, mesh, list(rules))


def sharded_init(init_fn: Callable[..., Any], mesh: Mesh, rules: Sequence[tuple[str, Any]],
                 *args) -> tuple[Any, Any]:
  """Runs `init_fn(*args)` under jit so its outputs are created already sharded.

  `jax.eval_shape` gives the (boxed) shapes without computing anything; the logical names on
  them give the shardings; `jit(..., out_shardings=...)` then materialises each array directly
  in its place, never whole on one device. Returns (unboxed values, their shardings).
  """
  abstract = jax.eval_shape(init_fn, *args)
  shardings = logical_shardings(abstract, mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(list(rules)):
    values = jax.jit(lambda *a: nn.meta.unbox(init_fn(*a)), out_shardings=shardings)(*args)
  return values, shardings
