"""A run's trainer: the placed parameters and optimizer state, stepped by ``StepPrograms``.

The state is checkpointed placement-free (``checkpoint``) and read back into
any setting's placements (``restore_targets``, ``Moments``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from optax import tree_utils as otu

from jaxoffload._compat import DEVICE_KIND
from jaxoffload.host.host_adamw import HostAdamW
from jaxoffload.memory import compiled_device_bytes
from jaxoffload.nn import remat
from jaxoffload.nn.model import Llama
from jaxoffload.nn.params import init_params
from jaxoffload.optim.offload_plan import leaf_path
from jaxoffload.train.checkpoints import host_checkpoint
from jaxoffload.train.optimizer import (Moments, device_shapes, host_adamw, moment_values,
                                        stored_moments, value_targets)
from jaxoffload.train.per_layer.overlap import OverlappedStep
from jaxoffload.train.programs import StepPrograms
from jaxoffload.train.setup import Setup

# A checkpoint's trees of the parameters' structure, whatever the setting.
STATE_ITEMS = ("params", "mu", "nu")


class CompiledStep(NamedTuple):
  """A step's compiled programs and the device memory they need.

  Attributes:
    programs: the step; or, summing on the host, the micro-batch's and the update's.
    device_bytes: XLA's device peak of the step: the largest program's arguments,
      outputs and temporaries (aliased donations once), with the state that stays
      in device memory beside it.
    host_temp_bytes: the largest program's host temporaries.
    phase_bytes: where the step's programs take turns (the micro-batches and the
      update), each one's peak, whose largest is ``device_bytes``; empty for one program.
  """

  programs: tuple[jax.stages.Compiled, ...]
  device_bytes: int
  host_temp_bytes: int
  phase_bytes: tuple[int, ...] = ()


class Trainer:
  """A run's parameters and optimizer state, and the jitted step that updates them.

  Attributes:
    params: the parameter leaves the step updates, in tree order: every leaf but
      the host kernel's.
    opt_state: the optimizer's state (``optimizer(setup)``).
    host: the host kernel's ``HostAdamW``, holding its leaves; None without it.
    programs: the jitted programs that step them (``StepPrograms``).

  Example:
    >>> setup = resolve(config)
    >>> trainer = Trainer(setup)
    >>> loss = trainer.step(setup.global_batch(0))
  """

  def __init__(self, setup: Setup, params: Any = None, moments: Optional[Moments] = None):
    """Places ``params`` (None: initialised from the seed) and ``moments`` (None: zeros)."""
    self._build(setup)
    leaves = jax.tree.leaves(_init_params(setup) if params is None else params)
    self.params = self.programs.device_only(leaves)
    self.host: Optional[HostAdamW] = (
        host_adamw(setup, self.programs.host_leaves(leaves)) if setup.host_kernel else None)
    if moments is None:
      self.opt_state = jax.device_put(self.programs.optimizer.init(device_shapes(setup)),
                                      self.programs.state_shardings)
    else:
      self._load_moments(moments)

  @classmethod
  def from_shapes(cls, setup: Setup) -> "Trainer":
    """A trainer whose parameters and state are shapes and placements, nothing allocated: it
    compiles (``compile``, with XLA's memory analysis of the step) but does not step.

    Example:
      >>> device_bytes = Trainer.from_shapes(setup).compile(tokens).device_bytes
    """
    trainer = cls.__new__(cls)
    trainer._build(setup)
    struct = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    leaves = [struct(x, s) for x, s in zip(jax.tree.leaves(setup.param_shapes),
                                           jax.tree.leaves(setup.param_shardings))]
    trainer.params = trainer.programs.device_only(leaves)
    trainer.host = None
    # What HostAdamW.params would be: each leaf in the dtype the device reads it in.
    trainer._host_shapes = [jax.ShapeDtypeStruct(p.shape, d, sharding=p.sharding) for p, d in
                            zip(trainer.programs.host_leaves(leaves),
                                setup.weight_transfer_dtypes)]
    trainer.opt_state = jax.tree.map(struct, trainer.programs.abstract_state,
                                     trainer.programs.state_shardings)
    return trainer

  def _build(self, setup: Setup) -> None:
    """What the step is, from ``setup`` alone."""
    self.setup = setup
    self.programs = StepPrograms(setup)
    self.overlapped = OverlappedStep(self.programs) if setup.runs_per_layer else None
    self._host_shapes: list[jax.ShapeDtypeStruct] = []
    self._compiled: tuple[jax.stages.Compiled, ...] = ()
    self._evaluation: Optional[jax.stages.Compiled] = None

  @property
  def host_params(self) -> list[jax.Array]:
    """What the step reads of the host kernel's leaves (none without it)."""
    return self._host_shapes if self.host is None else self.host.params

  def compile(self, tokens: jax.Array, compiler_options: Optional[dict] = None
              ) -> CompiledStep:
    """Compiles the step for batches like ``tokens``, with XLA's ``compiler_options``;
    later steps run these programs."""
    if self.overlapped is not None:
      return self._compile_overlapped(tokens, compiler_options)
    options = dict(compiler_options=compiler_options)
    if not self.setup.sums_on_host:
      self._compiled = (self.programs.step.lower(self.params, self.host_params, self.opt_state,
                                         tokens).compile(**options),)
      analysis = self._compiled[0].memory_analysis()
      return CompiledStep(self._compiled, compiled_device_bytes(analysis),
                          analysis.host_temp_size_in_bytes)
    sums = jax.eval_shape(self.programs.zero_sums)
    self._compiled = (
        self.programs.micro_step.lower(self.params, self.host_params, sums, tokens, 0,
                                       0).compile(**options),
        self.programs.update_step.lower(self.params, self.opt_state, sums, 0.0).compile(
            **options))
    micro, update = (program.memory_analysis() for program in self._compiled)
    # The optimizer state stays in device memory while the micro-batches run.
    resident = _device_bytes(self.opt_state)
    phases = compiled_device_bytes(micro) + resident, compiled_device_bytes(update)
    return CompiledStep(self._compiled, max(phases),
                        max(micro.host_temp_size_in_bytes, update.host_temp_size_in_bytes),
                        phases)

  def _compile_overlapped(self, tokens: jax.Array, compiler_options: Optional[dict]
                          ) -> CompiledStep:
    """``compile`` of the overlapped step's programs. Its device peak: what the step holds
    beside the parameters and state (``OverlappedStep.compile``: what a micro-batch's
    forward programs keep, the device leaves' gradients or the sums they come from), with
    the largest program's temporaries; or the update's, if larger."""
    programs, held = self.overlapped.compile(self.params, self.host_params, self.opt_state,
                                             tokens, compiler_options)
    self._compiled = tuple(programs.values())
    analyses = {name: program.memory_analysis() for name, program in programs.items()}
    update = analyses.pop("update")
    backward = (_device_bytes((self.params, self.opt_state)) + held
                + max(a.temp_size_in_bytes for a in analyses.values()))
    host_temp = max(a.host_temp_size_in_bytes for a in (update, *analyses.values()))
    phases = backward, compiled_device_bytes(update)
    return CompiledStep(self._compiled, max(phases), host_temp, phases)

  def step(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One update from ``tokens``; returns the loss (before the update) and the gradients'
    global norm (before clipping)."""
    if self.overlapped is not None:
      self.params, self.opt_state, loss, grad_norm = self.overlapped(
          self.params, self.host, self.opt_state, tokens)
      return loss, grad_norm
    if self.setup.sums_on_host:
      return self._step_summing_on_host(tokens)
    step = self._compiled[0] if self._compiled else self.programs.step
    self.params, self.opt_state, loss, grad_norm, host_grads, clip_factor = step(
        self.params, self.host_params, self.opt_state, tokens)
    if self.host is not None:
      self.host.update(host_grads, clip_factor)
    return loss, grad_norm

  def _step_summing_on_host(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``step`` a micro-batch at a time, the host summing its leaves' gradients."""
    programs = self.programs
    micro_step, update_step = self._compiled or (programs.micro_step, programs.update_step)
    sums, pending = self.programs.zero_sums(), None
    for index in range(self.setup.micro_batches):
      sums, host_grads = micro_step(self.params, self.host_params, sums, tokens, index,
                                    self.host.count)
      if pending is not None:  # The previous micro-batch's, while the device computes this one.
        self.host.accumulate(pending)
      pending = host_grads
    squares = self.host.accumulate(pending, square_sum=True)
    if jax.process_count() > 1:  # Each process summed its own shards.
      squares = float(np.sum(multihost_utils.process_allgather(np.float64(squares))))
    self.params, self.opt_state, loss, grad_norm, host_scale = update_step(
        self.params, self.opt_state, sums, squares)
    self.host.update((), host_scale)
    return loss, grad_norm

  def evaluate(self, tokens: jax.Array) -> jax.Array:
    """The loss on ``tokens`` at the current parameters, with no update."""
    if self.host is not None:
      self.host.apply_held()
    return (self._evaluation or self.programs.eval_loss)(self.params, self.host_params, tokens)

  def compile_evaluation(self, tokens: jax.Array) -> int:
    """Compiles the held-out loss for batches like ``tokens`` (``evaluate`` then runs it)
    and returns its device peak: XLA's for the program, with the optimizer state that stays
    in device memory beside it."""
    self._evaluation = self.programs.eval_loss.lower(self.params, self.host_params,
                                                     tokens).compile()
    return (compiled_device_bytes(self._evaluation.memory_analysis())
            + _device_bytes(self.opt_state))

  def checkpoint(self) -> dict:
    """The whole state as placement-free trees, for orbax: ``params`` (the host kernel's
    leaves as its float32 weights), and ``mu`` and ``nu`` like it. Any setting of the same
    model resumes from it (``restore_targets``). Host-resident leaves are the live buffers:
    save them before the next step (``Setup.state_in_host_memory``)."""
    if self.host is None:
      return self._trees([], [], [])
    self.host.apply_held()  # The overlapped step's update is part of this state.
    host = self.host.checkpoint(copy=False)  # The save finishes before the next update.
    return self._trees(host["params"], host["mu"], host["nu"])

  def checkpoint_items(self) -> dict:
    """What a save writes: ``checkpoint``'s trees, but the host kernel's leaves (None there)
    in a ``host_checkpoint.ITEM`` of their own, which writes them a few rows at a time from
    the live state instead of copying them whole. Joined to other processes
    (``distributed.initialize``), ``checkpoint``: orbax gathers each leaf's shards, as the
    host-memory guard counts."""
    if self.host is None or self.setup.config.distributed.initialize:
      return self.checkpoint()
    self.host.apply_held()
    paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        self.setup.param_shapes)[0]]
    host_paths = self.programs.host_leaves(paths)
    items = self._trees(*[[None] * len(host_paths)] * 3)
    shapes = self.programs.host_leaves(jax.tree.leaves(self.setup.param_shapes))
    read = lambda leaf: lambda name, rows: self.host.state.leaf_rows(name, leaf, rows)
    items[host_checkpoint.ITEM] = {path: host_checkpoint.HostLeaf(tuple(shape.shape), read(i))
                                   for i, (path, shape) in enumerate(zip(host_paths, shapes))}
    return items

  def _trees(self, params: list, mu: list, nu: list) -> dict:
    """The checkpoint's trees, given the host kernel's leaves of each."""
    device = lambda name: self.programs.device_only(self.programs.treedef.flatten_up_to(
        moment_values(otu.tree_get(self.opt_state, name))))
    # The device optimizer's moments of the host kernel's leaves are MaskedNodes, dropped.
    return {"params": self.programs.tree(self.params, params),
            "mu": self.programs.tree(device("mu"), mu), "nu": self.programs.tree(device("nu"), nu)}

  def restore_targets(self) -> dict:
    """What ``checkpoint`` returns, as this trainer's shapes, dtypes and placements: where
    orbax reads a checkpoint to (the host kernel's split masters in device memory,
    ``Setup.initial_param_shardings``). The host kernel's moments have no placement
    (``sharding`` None): they are read into numpy, one leaf at a time."""
    like = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    targets = {"params": jax.tree.map(like, self.setup.param_shapes,
                                      self.setup.initial_param_shardings)}
    host = [jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=None)
            for p in self.programs.host_leaves(jax.tree.leaves(self.setup.param_shapes))]
    for name in ("mu", "nu"):
      placed = jax.tree.leaves(value_targets(otu.tree_get(self.programs.abstract_state, name),
                                             otu.tree_get(self.programs.state_shardings, name)))
      targets[name] = self.programs.tree(placed, host)
    return targets

  def _load_moments(self, moments: Moments) -> None:
    """The optimizer state from ``moments``, each leaf where this setting keeps it."""
    read = lambda x: x() if callable(x) else x
    mu, nu = jax.tree.leaves(moments.mu), jax.tree.leaves(moments.nu)
    if self.host is not None:
      picked = lambda leaves: (read(x) for x, h in zip(leaves, self.programs.is_host) if h)
      self.host.load_moments({"count": moments.count, "mu": picked(mu), "nu": picked(nu)})
    # The device optimizer's moments, 8-bit ones encoded from the float32 values read.
    stored = lambda leaves, name: stored_moments(
        self.programs.treedef.unflatten(
            [optax.MaskedNode() if h else x for x, h in zip(leaves, self.programs.is_host)]),
        otu.tree_get(self.programs.abstract_state, name),
        otu.tree_get(self.programs.state_shardings, name))
    state = otu.tree_set(self.programs.abstract_state, mu=stored(mu, "mu"), nu=stored(nu, "nu"))
    # What is left unset is the step counts, each its own buffer (the step donates them).
    self.opt_state = jax.tree.map(
        lambda x, s: x if isinstance(x, jax.Array) else jax.device_put(
            np.asarray(moments.count, x.dtype), s), state, self.programs.state_shardings)


def _init_params(setup: Setup) -> Any:
  """The parameters, each leaf written once, straight into its placement."""
  # Initialised as one stack and cut at the groups: every offload setting starts
  # from the same weights, so their losses can be compared step by step.
  one_stack = Llama(setup.model, remat.layer_groups(setup.model.num_layers))
  return init_params(one_stack, jax.random.PRNGKey(setup.config.train.seed),
                     jnp.zeros((1, 2), jnp.int32), setup.initial_param_shardings,
                     groups=setup.groups)


def resident_device_bytes(trainer: Trainer) -> int:
  """The bytes one device holds of ``trainer``'s parameters and optimizer state between
  steps (arrays, or the shapes of ``Trainer.from_shapes``)."""
  return _device_bytes((trainer.params, trainer.opt_state))


def _device_bytes(tree: Any) -> int:
  """The bytes one device holds of ``tree``'s leaves in device memory (arrays or shapes)."""
  return max((sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                  for x in jax.tree.leaves(tree) if x.sharding.memory_kind == DEVICE_KIND
                  and device in x.sharding.device_set)
              for device in {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}),
             default=0)
