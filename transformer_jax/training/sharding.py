"""Device mesh, logical-axis rules and sharded initialisation.

The mesh has three axes (MaxText / Flax lm1b style):

  'data'    pure data parallelism: the batch is split, parameters are replicated.
  'fsdp'    fully sharded data parallelism: the batch is split *and* parameters and optimiser
            state are sharded (over their 'embed' dimension with the default rules); XLA
            all-gathers each weight where it is used and reduce-scatters its gradient.
  'tensor'  Megatron-style tensor parallelism: attention heads and FFN hidden units are split;
            activations are replicated over it, so the batch is not.

The model names logical axes on its parameters ('embed', 'heads', 'mlp', ...) and activations
('activation_batch', ...). The config maps logical names to mesh axes (rules as data); this
module turns that into `NamedSharding`s. One rule set serves every layout: a mesh axis of size
1 shards nothing, so mesh_shape (-1, 1, 1) is plain data parallelism.

Each parameter's mesh spec is fitted to its shape: mesh axes of size 1 are dropped (so specs
read as what is actually split), and a dimension whose size the mesh axes do not divide is
replicated instead (logged once per logical name), e.g. 4 heads on tensor=8.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import log

MESH_AXES = ('data', 'fsdp', 'tensor')
# Mesh axes over which the batch is split (jointly): both carry data.
DATA_AXES = ('data', 'fsdp')

Rules = Sequence[tuple[str, Any]]


def create_mesh(
  mesh_shape: Sequence[int] = (-1, 1, 1),
  axis_names: Sequence[str] = MESH_AXES,
  devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A mesh over `devices` (default: all); one -1 in mesh_shape takes the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  shape = list(mesh_shape)
  if len(shape) != len(axis_names):
    raise ValueError(
      f'mesh_shape {tuple(mesh_shape)} does not match axes {tuple(axis_names)}: '
      f'give one size per axis, e.g. {(-1,) + (1,) * (len(axis_names) - 1)}'
    )
  if shape.count(-1) > 1:
    raise ValueError(f'mesh_shape {tuple(mesh_shape)} has more than one -1')
  if any(
    s != -1 and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1)
    for s in shape
  ):
    raise ValueError(f'mesh_shape {tuple(mesh_shape)}: sizes must be positive integers or -1')
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f'mesh_shape {tuple(mesh_shape)} does not divide {len(devices)} devices')
    shape[shape.index(-1)] = len(devices) // known
  if int(np.prod(shape)) != len(devices):
    raise ValueError(
      f'mesh_shape {tuple(shape)} needs {int(np.prod(shape))} devices, have {len(devices)}'
    )
  return Mesh(np.asarray(devices).reshape(shape), tuple(axis_names))


def normalize_rules(rules: Rules) -> list[tuple[str, Any]]:
  """Rules as flax wants them: (logical name, None | mesh axis | tuple of mesh axes) pairs.

  Accepts lists where tuples are expected (a config read back from JSON).
  """
  normalized = []
  for rule in rules:
    if len(rule) != 2:
      raise ValueError(f'logical axis rule {rule!r} is not a (logical name, mesh axes) pair')
    name, axes = rule
    if isinstance(axes, list):
      axes = tuple(axes)
    normalized.append((name, axes))
  return normalized


def data_axes(mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes that split the batch."""
  return tuple(axis for axis in DATA_AXES if axis in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
  """Number of distinct batch shards: the product of the data-carrying axes' sizes."""
  return int(np.prod([mesh.shape[axis] for axis in data_axes(mesh)]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split jointly over every mesh axis that carries data."""
  return NamedSharding(mesh, PartitionSpec(data_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def fit_spec(
  spec: PartitionSpec,
  shape: Sequence[int],
  mesh_shape: dict[str, int],
) -> tuple[PartitionSpec, list[tuple[int, Any]]]:
  """`spec` made valid for an array of `shape` on a mesh of `mesh_shape` ({axis: size}).

  Drops mesh axes of size 1; replaces a dimension's mesh axes by None (replication) when their
  total size does not divide the dimension. Returns (spec, [(dim, dropped axes), ...]).
  """
  if len(spec) > len(shape):
    raise ValueError(f'partition spec {spec} has more entries than shape {tuple(shape)}')
  fitted, replicated_dims = [], []
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is None or axes is PartitionSpec.UNCONSTRAINED:
      fitted.append(axes)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in axes if a not in mesh_shape]
    if unknown:
      raise ValueError(
        f'logical axis rules name mesh axes {unknown} that the mesh '
        f'{tuple(mesh_shape)} does not have'
      )
    axes = tuple(a for a in axes if mesh_shape[a] > 1)
    split = int(np.prod([mesh_shape[a] for a in axes]))
    if size % split:
      replicated_dims.append((dim, axes))
      axes = ()
    fitted.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*fitted), replicated_dims


def _mesh_spec(leaf: Any, rules: list[tuple[str, Any]]) -> tuple[PartitionSpec, tuple]:
  """(mesh spec from the rules, logical names) of one (possibly boxed) leaf."""
  if isinstance(leaf, nn.LogicallyPartitioned):
    return nn.logical_to_mesh_axes(leaf.names, rules), tuple(leaf.names)
  if isinstance(leaf, nn.Partitioned):  # Names are mesh axes already.
    return PartitionSpec(*leaf.names), tuple(leaf.names)
  return PartitionSpec(), ()


def logical_shardings(abstract_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for a tree of (possibly `nn.Partitioned`-boxed) abstract values.

  The tree's structure is that of the unboxed values. Leaves without logical names are
  replicated; a dimension the mesh axes do not divide is replicated (and logged).
  """
  rules = normalize_rules(rules)
  mesh_shape = dict(mesh.shape)
  fallbacks: dict[tuple, int] = {}

  def leaf_sharding(leaf):
    spec, names = _mesh_spec(leaf, rules)
    value = leaf.value if isinstance(leaf, nn.meta.AxisMetadata) else leaf
    shape = getattr(value, 'shape', None)
    if shape is None:
      return NamedSharding(mesh, PartitionSpec())
    spec, replicated_dims = fit_spec(spec, shape, mesh_shape)
    for dim, axes in replicated_dims:
      key = (names[dim] if dim < len(names) else dim, shape[dim], axes)
      fallbacks[key] = fallbacks.get(key, 0) + 1
    return NamedSharding(mesh, spec)

  shardings = jax.tree_util.tree_map(
    leaf_sharding, abstract_tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
  )
  for (name, size, axes), count in sorted(fallbacks.items(), key=str):
    sizes = ' x '.join(f'{a}={mesh_shape[a]}' for a in axes)
    log(
      f'sharding: {name!r} of size {size} is not divisible by mesh axes {sizes}; '
      f'replicated along them instead ({count} arrays)'
    )
  return shardings


def _unbox(tree: Any) -> Any:
  """Boxed values -> plain arrays, without flax's sharding constraints (out_shardings place
  them; a constraint from the raw rules could ask for a split that does not divide)."""
  return jax.tree_util.tree_map(
    lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
    tree,
    is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
  )


def sharded_initializer(init_fn: Callable[..., Any], shardings: Any) -> Callable[..., Any]:
  """`init_fn` under jit, its outputs created already sharded: `jit(..., out_shardings=...)`
  materialises each array directly in its place (`shardings`, from `logical_shardings` of its
  `jax.eval_shape`), never whole on one device; boxed values come out unboxed. Call it under
  `jax.set_mesh(mesh)`."""
  return jax.jit(lambda *a: _unbox(init_fn(*a)), out_shardings=shardings)


# Environment variables by which a cluster manager says this process is one of several:
# (name, value -> whether it means more than one process).
_CLUSTER_ENV = (
  ('JAX_COORDINATOR_ADDRESS', bool),  # set by hand, or by launchers that speak JAX
  ('SLURM_NTASKS', lambda value: value.isdigit() and int(value) > 1),
  ('OMPI_COMM_WORLD_SIZE', lambda value: value.isdigit() and int(value) > 1),
  ('TPU_WORKER_HOSTNAMES', lambda value: ',' in value),  # Cloud TPU slice of several hosts
  ('MEGASCALE_COORDINATOR_ADDRESS', bool),  # Cloud TPU multislice
)


def multiprocess_environment() -> str | None:
  """The variable that shows this process is one of several, or None."""
  for name, means_several in _CLUSTER_ENV:
    value = os.environ.get(name)
    if value is not None and means_several(value):
      return name
  return None


def initialize_distributed(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  force: bool = False,
) -> bool:
  """Starts JAX's distributed runtime when this is one process of several; True if it did.

  Explicit arguments (a multi-GPU host, or processes launched by hand) take precedence;
  otherwise `jax.distributed.initialize()` finds its peers itself (Cloud TPU, SLURM, Open MPI)
  when the environment shows a multi-process job, or when `force` is set. Must run before
  anything touches a device.
  """
  if coordinator_address:
    if num_processes is None or process_id is None:
      raise UserInputError('--coordinator_address needs --num_processes and --process_id too')
    jax.distributed.initialize(
      coordinator_address, num_processes=num_processes, process_id=process_id
    )
  elif force or multiprocess_environment():
    jax.distributed.initialize()
  else:
    return False
  log(
    f'process {jax.process_index()} of {jax.process_count()}: '
    f'{jax.local_device_count()} local of {jax.device_count()} devices'
  )
  return True
